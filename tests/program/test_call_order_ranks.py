"""A model that registers a module late and calls it early (BART's ``layernorm_embedding``,
CLIP's vision tower declared after its text tower) across two gloo ranks: given ``sample``,
``pipepar.distributed.wrap`` lays the units out in the order the forward calls them, as
``pipepar.wrap`` does, so each stage's units run in one stretch and the loss, every gradient
and the gathered state equal the plain model's, for a model built real or on meta; without a
sample the units keep the order they were registered in and the first step refuses, naming
the cause."""

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


class LateNorm(nn.Module):
    """``norm_in`` is registered after the blocks and called before them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.norm_in = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_in(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def _model(device: str = "cpu") -> LateNorm:
    torch.manual_seed(0)
    with torch.device(device):
        return LateNorm()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _one(device: str, sample: bool) -> dict[str, Any]:
    import pipepar.distributed as ppd

    state = copy.deepcopy(_model().state_dict())
    x, y = _batch()
    pipe = ppd.wrap(_model(device), [3, 3], chunks=4, schedule="1f1b", state_dict=state,
                    sample=x if sample else None, timeout=60)  # fmt: skip
    try:
        loss = pipe.step(x, loss_fn=F.cross_entropy, target=y)
        grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
        full = {k: v.numpy().copy() for k, v in pipe.full_state_dict().items()}
    except ppd.PipelineError as error:
        return {"error": str(error)}
    finally:
        pipe.close()
    return {"loss": loss, "grads": grads, "full": full}


def _two_ranks(rank: int) -> dict[str, Any]:
    return {
        "real": _one("cpu", sample=True),
        "meta": _one("meta", sample=True),
        "registered": _one("cpu", sample=False),
    }


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("built", ["real", "meta"])
def test_given_a_sample_the_stages_follow_the_call_order_and_equal_the_plain_model(
    ranks: dict[int, Any], built: str
) -> None:
    plain = _model()
    x, y = _batch()
    loss = F.cross_entropy(plain(x), y)
    loss.backward()
    got = [ranks[r][built] for r in (0, 1)]
    ranks_equal_plain([(g["loss"], g["grads"]) for g in got], loss, plain)
    for g in got:
        assert sorted(g["full"]) == sorted(plain.state_dict())
        for k, v in plain.state_dict().items():
            assert torch.equal(torch.from_numpy(g["full"][k]), v), k
    # norm_in, blocks 0 and 1 on rank 0: the call order, not the registration order
    assert set(got[0]["grads"]) == {
        *(f"norm_in.{n}" for n in ("weight", "bias")),
        *(f"blocks.{k}.{n}" for k in (0, 1) for n in ("weight", "bias")),
    }


def test_without_a_sample_the_registration_order_is_refused_at_the_first_step(
    ranks: dict[int, Any],
) -> None:
    for r in (0, 1):
        text = ranks[r]["registered"].get("error", "no error")
        assert "stretch of the forward" in text and "sample=" in text, (r, text)
