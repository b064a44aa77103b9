"""``gc_every`` on a pipe in one process: Python's collector is off while ``pipe.step`` runs
(the loss, computed on a worker thread, sees it off), back on after it, and the step's loss
and gradients are those of a pipe that leaves the collector alone, for an ``nn.Sequential``
and for any other model."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipepar


class Blocks(nn.Module):
    """Not an nn.Sequential: its forward is cut into stages as it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "chain":
        return nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    return Blocks()


def _steps(model: nn.Module, kind: str, gc_every: int | None) -> dict[str, Any]:
    layout: dict[str, Any] = {"balance": [2, 2]} if kind == "chain" else {"split": ["blocks.2"]}
    pipe = pipepar.wrap(model, devices=["cpu", "cpu"], chunks=4, gc_every=gc_every, **layout)
    seen: list[bool] = []

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        seen.append(gc.isenabled())
        return nn.functional.mse_loss(out, target)

    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=data), torch.randn(8, 6, generator=data)
    losses = [float(pipe.step(x, target=y, loss_fn=loss_fn)) for _ in range(3)]
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    return {"seen": seen, "losses": losses, "grads": grads, "after": gc.isenabled()}


@pytest.mark.parametrize("kind", ["chain", "program"])
def test_the_collector_is_off_during_each_step_only(kind: str) -> None:
    assert gc.isenabled()
    model = _model(kind)
    plain = _steps(copy.deepcopy(model), kind, None)
    managed = _steps(model, kind, 2)
    assert plain["seen"] and all(plain["seen"])
    assert len(managed["seen"]) == len(plain["seen"]) and not any(managed["seen"])
    assert managed["after"] and gc.isenabled()
    assert managed["losses"] == plain["losses"]
    for name, g in plain["grads"].items():
        torch.testing.assert_close(managed["grads"][name], g, rtol=0, atol=0)


def test_wrap_refuses_a_gc_every_below_one() -> None:
    with pytest.raises(ValueError, match="gc_every must be at least 1, but got 0"):
        pipepar.wrap(_model("chain"), [2, 2], devices=["cpu", "cpu"], gc_every=0)
