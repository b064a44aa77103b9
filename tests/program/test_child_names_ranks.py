"""A model whose child bears the name of an attribute of the pipe across ranks (timm's ConvNeXt,
RegNet and CSPNet keep their blocks in ``stages``, the name of the pipe's list of the rank's
stage indices): on two gloo ranks the pipe takes the child as its own under that name, any
model and an ``nn.Sequential`` alike, the loss and every gradient equal the plain model's, and
``pipe.stages`` still gives the rank's stages."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._ranks import spawn
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Staged(nn.Module):
    """Blocks in ``stages``, as timm's ConvNeXt has them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.stages = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [("stem", nn.Linear(4, 6)), ("stages", Block()), ("head", nn.Linear(6, 3))]
    return nn.Sequential(OrderedDict(layers))


def _model() -> Staged:
    torch.manual_seed(0)
    return Staged()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _one(model: nn.Module, balance: list[int]) -> tuple[float, dict[str, Any], list[int]]:
    import pipepar.distributed as ppd

    state = copy.deepcopy(model.state_dict())
    pipe = ppd.wrap(model, balance, chunks=4, schedule="1f1b", state_dict=state)
    x, y = _batch()
    loss = pipe.step(x, loss_fn=F.cross_entropy, target=y)
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    stages = list(pipe.stages)
    pipe.close()
    return loss, grads, stages


def _two_ranks(rank: int) -> dict[str, Any]:
    return {"model": _one(_model(), [2, 3]), "chain": _one(_chain(), [2, 1])}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("name", ["model", "chain"])
def test_a_child_named_like_the_pipes_attribute_trains_as_the_plain_model(
    ranks: dict[int, Any], name: str
) -> None:
    plain = _model() if name == "model" else _chain()
    x, y = _batch()
    loss = F.cross_entropy(plain(x), y)
    loss.backward()
    ranks_equal_plain([ranks[r][name][:2] for r in (0, 1)], loss, plain)
    assert [ranks[r][name][2] for r in (0, 1)] == [[0], [1]]
