"""A weight one stage holds and a later stage on another rank uses in the model's own code
(CLIP's ``logit_scale``: the model's own weight, so held by stage 0, scales the logits at the
end), across two gloo ranks: the holder's rank sends it as a value of its stage, the user's
rank sends its gradient back, and over two steps (the first learns what crosses, the second
follows it) the loss and every gradient equal the plain model's. A weight of a later stage
read before its layers (DeBERTa-v2's ``rel_embeddings.weight``) would travel against the
pipeline: refused on every rank, naming it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._ranks import spawn
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow


class Scaled(nn.Module):
    """``scale`` is the model's own weight, used after the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale.exp()


class ReadEarly(nn.Module):
    """``table``'s weight is read before the layers, its module registered after them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.table = nn.Embedding(1, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table.weight
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _model(kind: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return kind()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)


def _scaled() -> tuple[float, dict[str, Any]]:
    import pipepar.distributed as ppd

    model = _model(Scaled)
    pipe = ppd.wrap(model, [2, 2], chunks=4, schedule="1f1b",
                    state_dict=copy.deepcopy(model.state_dict()), timeout=60)  # fmt: skip
    x, y = _batch()
    losses = [pipe.step(x, loss_fn=F.mse_loss, target=y) for _ in range(2)]
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return sum(losses), grads


def _read_early() -> str:
    import pipepar.distributed as ppd

    pipe = ppd.wrap(_model(ReadEarly), [2, 3], chunks=2, timeout=60)
    x, y = _batch()
    try:
        pipe.step(x, loss_fn=F.mse_loss, target=y)
    except ppd.PipelineError as error:
        return str(error)
    finally:
        pipe.close()
    return "no error"


def _two_ranks(rank: int) -> dict[str, Any]:
    return {"scaled": _scaled(), "read_early": _read_early()}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def test_a_weight_of_an_earlier_stage_used_at_the_end_trains_as_the_plain_model(
    ranks: dict[int, Any],
) -> None:
    plain = _model(Scaled)
    x, y = _batch()
    loss = sum(F.mse_loss(plain(x), y) for _ in range(2))
    for _ in range(2):
        F.mse_loss(plain(x), y).backward()
    ranks_equal_plain([ranks[r]["scaled"] for r in (0, 1)], loss, plain)


def test_a_weight_of_a_later_stage_read_early_is_refused_naming_it(ranks: dict[int, Any]) -> None:
    for r in (0, 1):
        text = ranks[r]["read_early"]
        assert "uses the weight 'table.weight'" in text, (r, text)
