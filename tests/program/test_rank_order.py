"""A model whose forward calls its units in another order than it declares them: in one process
a stage may use an earlier stage's unit again (its weight crosses, as a tied one does); across
ranks that weight is on another rank, and the error says so and how to split instead."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipepar

pytestmark = pytest.mark.slow


class Lists(nn.Module):
    """Two lists of Linears, registered one list after the other, called in turns."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.second = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, b in zip(self.first, self.second):
            x = b(torch.tanh(a(x)))
        return x


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


def test_one_process_runs_a_unit_of_an_earlier_stage_again() -> None:
    torch.manual_seed(0)
    model = Lists()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=["first.2"], devices=["cpu", "cpu"], chunks=2)
    x, y = _data()
    pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(plain(x), y).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def _on_ranks(rank: int) -> str:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    pipe = ppd.wrap(Lists(), split=["first.2"], chunks=2)
    x, y = _data()
    try:
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        return "no error"
    except Exception as err:  # the message is what is checked
        return str(err)
    finally:
        pipe.close()


def test_ranks_name_the_weight_another_rank_holds_and_the_fix() -> None:
    from tests._ranks import spawn

    found: dict[int, Any] = spawn(2, _on_ranks)
    for rank in (0, 1):
        message = found[rank]
        assert (
            "stage 1 uses the weight 'first.1.weight' (shape (8, 8)) that a stage on another rank "
            "holds" in message
        )
        assert "pass sample=<a batch>" in message and "declare the modules in that order" in message
