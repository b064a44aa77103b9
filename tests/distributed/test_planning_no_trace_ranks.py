"""``pipepar.distributed.wrap(model, plan="auto", sample=x)``: group rank 0 plans by running
its model's forward, the other ranks do not; afterwards rank 0's model is still the one it was
given (a cache its forward fills on the first call is empty again), so every rank computes as
the plain model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipepar.distributed as ppd
from tests._ranks import spawn
from tests.planner.test_planning_leaves_no_trace import _Cached

WORLD = 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Cached(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _step(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Model()
    plain = copy.deepcopy(model)
    sample, x, y = torch.randn(8, 4) + 3, torch.randn(8, 4), torch.randn(8, 4)
    # One micro-batch: the cache then holds the whole batch's mean, as the plain model's does.
    pipe = ppd.wrap(model, plan="auto", sample=sample, dp=1, chunks=1)
    kept = model.first.offset is None
    loss = pipe.step(x, loss_fn=nn.functional.mse_loss, target=y)
    want = nn.functional.mse_loss(plain(x), y)
    pipe.close()
    return {"kept": kept, "error": abs(float(loss) - want.item())}


@pytest.mark.slow
def test_rank_0s_planning_leaves_its_model_as_the_other_ranks_have_it() -> None:
    got = spawn(WORLD, _step, timeout=240)
    for rank, result in got.items():
        assert result["kept"], f"rank {rank}: planning left the cache filled"
        assert result["error"] < 1e-6, f"rank {rank}: loss off by {result['error']}"
