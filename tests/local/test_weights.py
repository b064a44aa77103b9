"""Deferred weight gradients run early by an idle worker: order, ownership and results."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipepar
from pipepar.core.named_schedules import make
from pipepar.core.schedule import Action, Schedule
from pipepar.local import executor
from pipepar.local.weights import WeightQueue, shared_stages
from pipepar.program import run as program_run

CPU = torch.device("cpu")


def test_a_stage_runs_its_w_in_order_one_at_a_time() -> None:
    q = WeightQueue((0, 1), [CPU, CPU], shared={0, 1}, m=2)
    q.ready(1, 0)
    q.ready(1, 1)
    assert q.unfinished(0) and q.unfinished(1)
    assert q.claim_any(0) == (1, 0)  # worker 0 may take stage 1's W: same device
    assert not q.runnable(0) and q.claim_any(1) is None  # W(1, 1) waits for W(1, 0)
    q.release(1)
    assert q.claim(1, 1)  # its own worker reaches it in its list
    q.release(1)
    assert not q.claim(1, 0)  # already run by worker 0: skipped
    q.ready(0, 0)
    q.ready(0, 1)
    assert q.claim(0, 0) and q.claim_any(1) is None  # stage 0's W(0, 1) waits for W(0, 0)
    q.release(0)
    assert q.claim_any(1) == (0, 1)
    q.release(0)
    assert not q.unfinished(0) and not q.unfinished(1)  # every W claimed: nothing to wait for


def test_the_owner_waits_for_an_earlier_w_of_its_stage_then_runs_its_own() -> None:
    q = WeightQueue((0, 1), [CPU, CPU], shared={1}, m=2)
    q.ready(1, 0)
    q.ready(1, 1)
    assert q.claim_any(0) == (1, 0)
    claimed = threading.Event()
    owner = threading.Thread(target=lambda: q.claim(1, 1) and claimed.set())
    owner.start()
    assert not claimed.wait(0.05)  # W(1, 1) must not start before W(1, 0) ends
    q.release(1)
    owner.join(5)
    assert claimed.is_set()


def test_workers_on_different_devices_keep_their_own_w() -> None:
    q = WeightQueue((0, 1), [CPU, torch.device("meta")], shared={0, 1}, m=1)
    q.ready(1, 0)
    assert q.claim_any(0) is None and q.claim_any(1) == (1, 0)


def test_only_stages_whose_every_backward_splits_in_order_take_part() -> None:
    assert shared_stages(make("zb-h1", 2, 4, n_workers=2)) == {0, 1}
    assert shared_stages(make("1f1b", 2, 4, n_workers=2)) == set()
    w = [a for a in make("zb-h1", 2, 2, n_workers=2).actions[1] if a.kind == "W"]
    assert [a.microbatch for a in w] == [0, 1]


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: its stage's B takes long, so the other worker idles."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return grad


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def _late_weights() -> Schedule:
    """Two stages, two micro-batches; stage 1 lists its W last, after a slow B."""
    a = Action
    first = (a(0, "F", 0), a(0, "F", 1), a(0, "B", 0), a(0, "W", 0), a(0, "B", 1), a(0, "W", 1))
    last = (a(1, "F", 0), a(1, "B", 0), a(1, "F", 1), a(1, "B", 1), a(1, "W", 0), a(1, "W", 1))
    return Schedule("late-w", 2, 2, (first, last))


def _spy(stolen: list[tuple[int, int]]) -> Callable[[WeightQueue, int], tuple[int, int] | None]:
    """``WeightQueue.claim_any`` noting in ``stolen`` each W that worker 0 takes early."""
    claim_any = WeightQueue.claim_any

    def spy(self: WeightQueue, worker: int) -> tuple[int, int] | None:
        got = claim_any(self, worker)
        if got is not None and worker == 0:
            stolen.append(got)
        return got

    return spy


_XY = (
    torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
    torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),
)
"""The input and target of the early-W tests."""


def _early_w_is_bit_identical(
    monkeypatch: pytest.MonkeyPatch,
    model: nn.Module,
    engine: Any,
    steps: Callable[[nn.Module], Any],
) -> Any:
    """``steps(copy)`` wraps a copy of ``model`` (stage 1's B sleeping) and steps it on
    ``x, y`` of :data:`_XY`, once with the early W and once with each W where listed
    (``engine.shared_stages`` off): worker 0 ran stage 1's W0 early, and the gradients equal
    the listed order's bit for bit and the plain model's. Returns the early run's pipe."""
    stolen: list[tuple[int, int]] = []

    def grads(shared: bool) -> tuple[list[torch.Tensor], Any]:
        copy_ = copy.deepcopy(model)
        if shared:
            monkeypatch.setattr(WeightQueue, "claim_any", _spy(stolen))
        else:
            monkeypatch.setattr(engine, "shared_stages", lambda schedule: set())
        pipe = steps(copy_)
        monkeypatch.undo()
        return [p.grad for p in copy_.parameters()], pipe

    early, pipe = grads(shared=True)
    assert (1, 0) in stolen  # worker 0 ran W0 of stage 1 while stage 1's B1 slept
    x, y = _XY
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    listed, _ = grads(shared=False)
    for a, b, p in zip(early, listed, plain.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, p.grad)
    return pipe


def test_an_idle_worker_runs_a_neighbours_w_and_the_gradients_stay_bit_identical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), _Slow(), nn.Linear(8, 8))

    def steps(copy_: nn.Module) -> Any:
        pipe = pipepar.wrap(
            copy_, [1, 3], devices=["cpu", "cpu"], chunks=2, schedule=_late_weights(), trace=True
        )
        pipe.step(*_XY, F.mse_loss)
        return pipe

    pipe = _early_w_is_bit_identical(monkeypatch, model, executor, steps)
    events = pipe.tracer.events if pipe.tracer else []
    ran = [(e.stage, e.microbatch, e.worker) for e in events if e.kind == "weight"]
    assert (1, 0, 0) in ran  # the timeline says who ran it
    assert sorted((stage, i) for stage, i, _ in ran) == [(0, 0), (0, 1), (1, 0), (1, 1)]


class _Net(nn.Module):
    """The same layers as a model of its own (not an ``nn.Sequential``): a model pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.slow, self.c = (
            nn.Linear(8, 8),
            nn.Linear(8, 8),
            _Slow(),
            nn.Linear(8, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.slow(self.b(self.a(x))))


def test_a_model_pipes_idle_worker_runs_a_neighbours_w_and_the_gradients_stay_bit_identical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    x, y = _XY

    def steps(copy_: nn.Module) -> Any:
        pipe = pipepar.wrap(
            copy_, [1, 3], devices=["cpu", "cpu"], chunks=2, schedule=_late_weights()
        )
        for _ in range(2):  # the first step learns the route; the second follows it
            copy_.zero_grad(set_to_none=True)
            pipe.step(x, loss_fn=F.mse_loss, target=y)
        return pipe

    _early_w_is_bit_identical(monkeypatch, _Net(), program_run, steps)


class _ScaleFailing(torch.autograd.Function):
    """``x * scale`` whose backward fails while ``fail`` is set."""

    fail = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, scale = ctx.saved_tensors
        if _ScaleFailing.fail:
            raise ValueError("the scale's gradient failed")
        dscale = (grad * x).sum() if ctx.needs_input_grad[1] else None
        return grad * scale, dscale


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleFailing.apply(x, self.scale)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_a_failing_backward_reaches_the_caller_while_idle_workers_wait_for_w(
    schedule: str,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Scale(), nn.Linear(8, 8), _Scale())
    pipe = pipepar.wrap(model, [1, 1, 1, 1] if schedule == "zb-v" else [2, 2],
                        devices=["cpu", "cpu"], chunks=4, schedule=schedule)  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="the scale's gradient failed") as caught:
        pipe.step(x, y, F.mse_loss)
    assert "pipepar: raised in stage" in "".join(getattr(caught.value, "__notes__", []))
    _ScaleFailing.fail = False
    try:
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, F.mse_loss)
    finally:
        _ScaleFailing.fail = True
    plain = copy.deepcopy(model)
    torch.testing.assert_close(loss, F.mse_loss(plain(x), y))
