"""A step under a torch-function or dispatch mode of the caller's: torch's ``FlopCounterMode``.

A mode belongs to the thread that entered it, so a step run on the pipe's workers ran the
model's operations outside it (a FLOP count of 0); and the module tracker the counter uses
hooks each module's inputs for the backward, which failed on the leaves a stage is handed
(autograd cannot say whether its engine will reach a leaf while it computes the gradients of
chosen inputs). Each test counts the step's FLOPs against the plain model's, on the workers
and on the calling thread, and checks the gradients too.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import pipepar
from pipepar.local.thread_choice import under_callers_mode
from tests._foreign_models import NanoGPT, nano_batch


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))


def _flops(run: object) -> int:
    with FlopCounterMode(display=False) as counter:
        run()  # type: ignore[operator]
    return counter.get_total_flops()


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """The plain model's FLOPs for a training step and for its forward alone."""
    plain = copy.deepcopy(model)
    step = _flops(lambda: nn.functional.mse_loss(plain(x), y).backward())
    with torch.no_grad():
        forward = _flops(lambda: plain(x))
    return step, forward


@pytest.mark.parametrize("run_on", ["workers", "caller"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("call", ["step", "backward"])
def test_flop_counter_counts_the_steps_operations(
    monkeypatch: pytest.MonkeyPatch, run_on: str, checkpoint: str, call: str
) -> None:
    """Every operation of the step is counted: the plain model's, and on a checkpointed
    micro-batch its forward again (2 micro-batches: half the batch recomputed, as torch's own
    checkpoint counts it); the gradients are the plain model's."""
    monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
    model, x, y = _model(), torch.randn(8, 16), torch.randn(8, 16)
    expected, forward = _plain(model, x, y)
    if checkpoint == "except_last":
        expected += forward // 2
    pipe = pipepar.wrap(
        copy.deepcopy(model),
        balance=[2, 2],
        devices=["cpu", "cpu"],
        chunks=2,
        checkpoint=checkpoint,
    )

    def run() -> None:
        if call == "step":
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        else:
            nn.functional.mse_loss(pipe(x), y).backward()

    for _ in range(2):  # the first call learns, the second follows what it learned
        pipe.zero_grad()
        assert _flops(run) == expected
    nn.functional.mse_loss(model(x), y).backward()
    for mine, theirs in zip(pipe.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7)


def test_a_mode_of_the_callers_is_told_from_pipepars_own() -> None:
    """The caller's modes, not the default device's (the workers need it not)."""
    assert not under_callers_mode()
    with torch.device("cpu"):
        assert not under_callers_mode()
    with FlopCounterMode(display=False):
        assert under_callers_mode()


class _Products(TorchDispatchMode):
    """Counts the matrix products dispatched while it is entered (no module hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.seen[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("run_on", ["workers", "caller"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_mode_sees_the_products_of_a_model_cut_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, run_on: str, schedule: str
) -> None:
    """A model with its own loss, cut while it runs: its forward computes on a thread per
    micro-batch, which enters the caller's mode; the mode sees the plain model's products (per
    micro-batch: twice as many calls), on the first call (learning the cut) and the next
    (following it), and the gradients are the plain model's. (Not a zero-bubble schedule: its
    W sums each weight product into the gradient in place, ``addmm_``.)"""
    monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
    torch.manual_seed(0)
    model = NanoGPT()
    idx, targets = nano_batch()
    plain = copy.deepcopy(model)
    with _Products() as counted:
        plain(idx, targets)[1].backward()  # type: ignore[union-attr]
    expected = Counter({name: 2 * n for name, n in counted.seen.items()})
    pipe = pipepar.wrap(
        copy.deepcopy(model), split=["h.2"], devices=["cpu", "cpu"], chunks=2, schedule=schedule
    )
    for _ in range(2):
        pipe.zero_grad()
        with _Products() as counted:
            pipe.step(idx, targets=targets)
        assert counted.seen == expected
    for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_a_module_tracker_on_a_model_cut_while_it_runs_is_told_what_to_do() -> None:
    """Its stages' units are handed leaves, of which torch's module tracker cannot ask during
    a stage's backward: an error saying so and what to do, not torch's own."""
    pipe = pipepar.wrap(NanoGPT(), split=["h.2"], devices=["cpu", "cpu"], chunks=2)
    idx, targets = nano_batch()
    refused = pytest.raises(RuntimeError, match=r"an nn\.Sequential of the model's blocks")
    with refused, FlopCounterMode(display=False):
        pipe.step(idx, targets=targets)
