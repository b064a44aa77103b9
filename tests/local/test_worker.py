"""A failing layer's own exception reaches the caller; no worker hangs; the pipe stays usable."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import pipepar


class Boom(Exception):
    pass


class FailOn(nn.Module):
    """Raises on the call whose batch contains the value ``trigger`` in row 0, column 0."""

    def __init__(self, trigger: float) -> None:
        super().__init__()
        self.trigger = trigger
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and bool((x[:, 0] == self.trigger).any()):
            raise Boom(f"bad row {self.trigger}")
        return x


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        raise Boom("backward failed")


class FailInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailBackward.apply(x) if self.armed else x


def _batch() -> torch.Tensor:
    x = torch.randn(8, 4)
    x[:, 0] = torch.arange(8, dtype=torch.float32) * 10  # rows 0..7 carry 0, 10, ..., 70
    return x


def _pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipepar-stage")]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_forward_exception_reaches_caller(stage: int) -> None:
    layers: list[nn.Module] = [nn.Identity() for _ in range(3)]
    layers[stage] = FailOn(trigger=50.0)  # row 5 -> micro-batch 2 of 4
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), *layers), [2, 1, 1], devices=["cpu"] * 3, chunks=4
    )
    pipe[0].weight.data = torch.eye(4)
    pipe[0].bias.data.zero_()
    with pytest.raises(Boom, match="bad row 50") as info:
        pipe(_batch())
    note = " ".join(getattr(info.value, "__notes__", []))
    assert f"raised in stage {stage} (layers" in note
    assert "micro-batch 2, forward" in note
    pipe[stage + 1].armed = False  # the pipe stays usable
    pipe(_batch()).sum().backward()
    assert pipe[0].weight.grad is not None


def test_backward_exception_reaches_caller_and_grads_untouched() -> None:
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), FailInBackward(), nn.Linear(4, 4)),
        [1, 2],
        devices=["cpu", "cpu"],
        chunks=4,
    )
    out = pipe(torch.randn(8, 4))
    with pytest.raises(Boom, match="backward failed") as info:
        out.sum().backward()
    assert "backward" in " ".join(info.value.__notes__)
    assert all(p.grad is None for p in pipe.parameters())  # no half-accumulated gradient
    pipe[1].armed = False
    pipe(torch.randn(8, 4)).sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())


def test_exception_with_many_pipes_alive() -> None:
    bad = pipepar.wrap(
        nn.Sequential(nn.Identity(), FailOn(0.0)), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    good = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), nn.Identity()), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    for _ in range(3):
        with pytest.raises(Boom):
            bad(torch.zeros(4, 4))
        good(torch.randn(4, 4)).sum().backward()


def test_worker_threads_stop_on_close() -> None:
    before = set(_pipe_threads())
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    pipe(torch.randn(4, 4)).sum().backward()
    mine = set(_pipe_threads()) - before
    assert len(mine) == 2
    pipe.close()
    for t in mine:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in mine)


def test_one_math_thread_per_stage_on_two_cores() -> None:
    pipe = pipepar.wrap(
        nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], devices=["cpu", "cpu"], threads=1
    )
    assert pipe.threads == [1, 1]
    seen: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return x

    pipe = pipepar.wrap(nn.Sequential(Probe(), Probe()), [1, 1], devices=["cpu", "cpu"], threads=1)
    pipe(torch.zeros(2, 2))
    assert seen == [1, 1]


@pytest.mark.parametrize(("chunks", "want"), [(1, 4), (2, 4), (3, 2), (8, 2)])
def test_default_threads_share_the_cores_among_stages_that_overlap(chunks: int, want: int) -> None:
    # Two stages compute at once K*M/(M+K-1) = 1, 1.33, 1.5, 1.78 on average: rounded 1 or 2.
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
        pipe = pipepar.wrap(model, [1, 2], devices=["cpu", "cpu"], chunks=chunks)
    finally:
        torch.set_num_threads(previous)
    assert pipe.threads == [want, want]


@pytest.mark.usefixtures("ctrl_c")
def test_keyboard_interrupt_stops_cleanly() -> None:
    import _thread
    import time

    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.2)
            return x

    pipe = pipepar.wrap(nn.Sequential(Slow(), Slow()), [1, 1], devices=["cpu", "cpu"], chunks=8)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        pipe(torch.randn(8, 2))
    assert time.perf_counter() - start < 1.5  # not the full 8 x 0.2 s x 2 stages
    timer.join()
    assert pipe(torch.randn(2, 2)).shape == (2, 2)  # usable afterwards
