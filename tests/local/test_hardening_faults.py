"""Faults in any stage, micro-batch and phase: the caller gets the original exception, named.

Every case checks the same four promises: the exception object the layer raised reaches the
caller (same type, same instance) with a note naming the stage, micro-batch and phase; no
gradient is half-accumulated; the pipe's worker threads are idle (not stuck) and end on
``close()``; the next step gives the plain model's gradients. A watchdog turns a hang into a
failure with every thread's stack instead of a stalled CI job.
"""

from __future__ import annotations

import _thread
import copy
import faulthandler
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.recompute import is_recomputing

K, M, ROWS = 3, 4, 2  # stages, micro-batches, rows per micro-batch
WIDTH = 6


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


class Boom(Exception):
    """A user exception whose constructor needs two arguments (it must never be rebuilt)."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(f"boom {code} at {where}")
        self.code = code


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fault):  # type: ignore[no-untyped-def]
        # A weak reference: a module held by ctx would form a cycle through autograd's C++
        # graph that Python's garbage collector cannot see, and keep the whole pipe alive.
        ctx.fault = weakref.ref(fault)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        raise ctx.fault().make()


class Fault(nn.Module):
    """Passes ``(x, row_ids)`` through; raises in one micro-batch and phase when armed."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.when: tuple[int, str] | None = None  # (micro-batch, "forward"|"backward"|"recompute")
        self.error: Exception | None = None  # what to raise; None: a fresh Boom
        self.raised: list[BaseException] = []

    def make(self) -> Exception:
        error = self.error if self.error is not None else Boom(-1, self.name)
        self.raised.append(error)
        return error

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, ids = value
        if self.when is None or int(ids[0]) // ROWS != self.when[0]:
            return x, ids
        phase = self.when[1]
        if phase == "forward" and not is_recomputing():
            raise self.make()
        if phase == "recompute" and is_recomputing():
            raise self.make()
        if phase == "backward":
            x = _RaiseInBackward.apply(x, self)
        return x, ids


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, ids = value
        return torch.tanh(self.lin(x)), ids


class Head(nn.Module):
    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return value[0]


def _model() -> nn.Sequential:
    """Stage j = [Lin, Fault j] (the last stage also has the Head); row ids ride along."""
    layers: list[nn.Module] = []
    for j in range(K):
        layers += [Lin(), Fault(f"fault{j}")]
    return nn.Sequential(*layers, Head())


def _pipe(model: nn.Sequential, checkpoint: str) -> pipepar.Pipe:
    return pipepar.wrap(model, [2, 2, 3], devices=["cpu"] * K, chunks=M, checkpoint=checkpoint)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(M * ROWS, WIDTH), torch.arange(M * ROWS)


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pipepar-stage")}


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    model(batch).square().sum().backward()


def _assert_usable_like_plain(pipe: pipepar.Pipe, plain: nn.Module) -> None:
    pipe.zero_grad(set_to_none=True)
    batch = _batch()
    _step(pipe, batch)
    _step(plain, batch)
    for (name, a), b in zip(pipe.named_parameters(), plain.parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def _assert_threads_end(pipe: pipepar.Pipe, before: set[threading.Thread]) -> None:
    mine = _threads() - before
    assert len(mine) <= K  # idle workers, kept for the next step; nothing extra
    pipe.close()
    for t in mine:
        t.join(timeout=5)
    assert not [t.name for t in mine if t.is_alive()]


@pytest.mark.parametrize("phase", ["forward", "backward", "recompute"])
@pytest.mark.parametrize("micro_batch", range(M))
@pytest.mark.parametrize("stage", range(K))
def test_fault_anywhere_reaches_the_caller(stage: int, micro_batch: int, phase: str) -> None:
    before = _threads()
    model = _model()
    plain = copy.deepcopy(model)
    pipe = _pipe(model, "always" if phase == "recompute" else "except_last")
    fault: Fault = pipe[2 * stage + 1]
    fault.when = (micro_batch, phase)
    fault.error = Boom(stage * 10 + micro_batch, phase)
    batch = _batch()
    with pytest.raises(Boom) as info:
        _step(pipe, batch)
    assert info.value is fault.raised[0]  # the very object the layer raised
    assert info.value.code == stage * 10 + micro_batch
    shown = "forward" if phase == "forward" else "backward"
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("pipepar:")]
    assert len(notes) == 1, notes
    assert f"raised in stage {stage} (layers" in notes[0]
    assert notes[0].endswith(f"micro-batch {micro_batch}, {shown}")
    assert all(p.grad is None for p in pipe.parameters())  # nothing half-accumulated
    fault.when, fault.error = None, None
    fault.raised.clear()  # tracebacks hold the failed step's frames: let them go
    _assert_usable_like_plain(pipe, plain)
    _assert_threads_end(pipe, before)


class Custom(Exception):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda: ValueError("bad value"),
        lambda: RuntimeError("CUDA-like failure"),
        Custom,
        lambda: Boom(7, "x"),
        lambda: MemoryError("out of memory"),
        lambda: AssertionError("invariant"),
    ],
    ids=["ValueError", "RuntimeError", "Custom", "Boom", "MemoryError", "AssertionError"],
)
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_exception_type_and_instance_are_kept(make: Callable[[], Exception], phase: str) -> None:
    pipe = _pipe(_model(), "never")
    fault: Fault = pipe[3]
    fault.when, fault.error = (1, phase), make()
    with pytest.raises(type(fault.error)) as info:
        _step(pipe, _batch())
    assert info.value is fault.error and type(info.value) is type(fault.error)
    fault.error = None
    pipe.close()


def test_a_torch_error_inside_a_layer_keeps_its_message() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(5, 2))  # 4 -> 5 mismatch
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(RuntimeError, match=r"cannot be multiplied") as info:
        pipe(torch.randn(4, 4))
    assert "pipepar: raised in stage 1 (layers 2..2 on cpu), micro-batch 0, forward" in (
        info.value.__notes__
    )
    pipe.close()


def test_two_stages_failing_at_once_give_one_real_error() -> None:
    for _ in range(5):  # the failures race; whichever wins, the caller never sees Aborted
        pipe = _pipe(_model(), "never")
        for j, mb in ((0, 2), (2, 0)):
            fault: Fault = pipe[2 * j + 1]
            fault.when, fault.error = (mb, "forward"), Boom(j, "race")
        with pytest.raises(Boom) as info:
            _step(pipe, _batch())
        assert info.value.code in (0, 2)
        pipe.close()


def test_no_grad_and_eval_forward_faults_are_reported_too() -> None:
    pipe = _pipe(_model(), "except_last").eval()
    fault: Fault = pipe[3]
    fault.when = (3, "forward")
    with torch.no_grad(), pytest.raises(Boom) as info:
        pipe(_batch())
    assert any("stage 1" in n and "micro-batch 3, forward" in n for n in info.value.__notes__)
    fault.when = None
    with torch.no_grad():
        assert pipe(_batch()).shape == (M * ROWS, WIDTH)
    pipe.close()


def test_failure_in_the_loss_leaves_the_pipe_usable() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = _pipe(model, "except_last")
    out = pipe(_batch())
    with pytest.raises(IndexError):
        out[:, WIDTH + 3].sum().backward()  # the user's own bug, after the pipe
    del out  # never backpropagated: the run is dropped with the graph
    _assert_usable_like_plain(pipe, plain)
    pipe.close()


class CallCounter(nn.Module):
    """Raises ``Boom`` on its ``fail_on``-th forward call (counting from 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.fail_on = 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise Boom(self.calls, "counter")
        return x


@pytest.mark.parametrize("balance", [[5], [2, 3]])
def test_failed_step_leaves_no_deferred_batch_norm_statistics(balance: list[int]) -> None:
    # Micro-batches 0 and 1 pass both batch norms before micro-batch 2 fails; their statistics
    # must not leak into the next step's running mean and variance.
    def build() -> pipepar.Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 4), nn.BatchNorm1d(4), CallCounter(), nn.Linear(4, 4), nn.BatchNorm1d(4)
        )
        return pipepar.wrap(
            model,
            balance,
            devices=["cpu"] * len(balance),
            chunks=4,
            checkpoint="never",
            deferred_batch_norm=True,
        )

    failed, clean = build(), build()
    failed[2].fail_on = 3
    with pytest.raises(Boom):
        failed(torch.randn(8, 4) * 10 + 5)
    batch = torch.randn(8, 4)
    failed(batch)
    clean(batch)
    for key, value in clean.state_dict().items():
        assert torch.equal(failed.state_dict()[key], value), key


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x * 1.0


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return g


class SlowBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


@pytest.mark.usefixtures("ctrl_c")
def test_keyboard_interrupt_during_backward_stops_cleanly() -> None:
    model = nn.Sequential(nn.Linear(4, 4), SlowBackward(), nn.Linear(4, 4), SlowBackward())
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=8, checkpoint="never")
    out = pipe(torch.randn(16, 4))
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()  # 8 x 0.05 s per stage if not interrupted
    elapsed = time.perf_counter() - start
    timer.join()
    assert elapsed < 0.35, elapsed  # stopped after the actions already running
    assert all(p.grad is None for p in pipe.parameters())
    x = torch.randn(16, 4)
    pipe(x).sum().backward()
    plain(x).sum().backward()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    pipe.close()


class RaiseBase(nn.Module):
    """Raises a BaseException (not an Exception) from a worker thread."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error: BaseException | None = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return x


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_raised_in_a_worker_reach_the_caller(kind: type[BaseException]) -> None:
    error = kind()
    before = _threads()
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), Slow(), RaiseBase(error)),
        [2, 1],
        devices=["cpu", "cpu"],
        chunks=4,
    )
    with pytest.raises(type(error)) as info:
        pipe(torch.randn(8, 4))
    assert info.value is error
    pipe[2].error = None
    assert pipe(torch.randn(8, 4)).shape == (8, 4)
    _assert_threads_end(pipe, before)


def test_dropped_pipes_leave_no_threads() -> None:
    import gc

    before = _threads()
    for _ in range(5):
        pipe = _pipe(_model(), "except_last")
        pipe[1].when = (1, "forward")
        with pytest.raises(Boom):
            _step(pipe, _batch())
        del pipe
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads() - before
