"""What micro-batching may change, learned from the code's operations across two gloo ranks: a
nanoGPT-style model's own loss (under ``targets=``, ignore_index=-1) joined exactly, a loss_fn
that sums, and a contrastive model refused on every rank before any gradient, with its own
loss or a loss_fn."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._foreign_models import Contrastive, NanoGPT, PairLogits, nano_batch
from tests._ranks import spawn
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow


def _summed(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits, _ = output
    flat = logits.reshape(-1, logits.size(-1))
    return F.cross_entropy(flat, target.reshape(-1).clamp(min=0), reduction="sum")


def _pairs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def _steps(pipe: Any, *args: Any, **kwargs: Any) -> tuple[float, dict[str, Any]]:
    pipe.step(*args, **kwargs)  # learns, then follows what it learned
    pipe.zero_grad()
    loss = pipe.step(*args, **kwargs)
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    return loss, grads


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = NanoGPT()
    state = copy.deepcopy(model.state_dict())
    out: dict[str, Any] = {}
    pipe = ppd.wrap(model, split=["h.2"], chunks=4, schedule="1f1b", state_dict=state)
    idx, targets = nano_batch()
    out["own"] = _steps(pipe, idx, targets)
    out["summed"] = _steps(pipe, idx, loss_fn=_summed, target=targets)
    pipe.close()
    contrastive = ppd.wrap(Contrastive(), split=["text.0"], chunks=2)
    try:
        contrastive.step(torch.randn(8, 8), torch.randn(8, 8))
        out["coupled"] = "no error"
    except Exception as err:  # every rank stops, naming the operation
        out["coupled"] = f"{type(err).__name__}: {err}"
    out["grads after refusal"] = [p.grad is None for p in contrastive.parameters()]
    contrastive.close()
    towers = ppd.wrap(PairLogits(), split=["text"], chunks=2)
    try:  # a loss_fn of the logits cannot undo that each micro-batch paired its own rows
        towers.step(torch.randn(8, 8), torch.randn(8, 8), loss_fn=_pairs, target=torch.arange(8))
        out["coupled by loss_fn"] = "no error"
    except Exception as err:
        out["coupled by loss_fn"] = f"{type(err).__name__}: {err}"
    towers.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def _plain(loss_of: Any) -> tuple[torch.Tensor, NanoGPT]:
    torch.manual_seed(0)
    plain = NanoGPT()
    loss = loss_of(plain)
    loss.backward()
    return loss, plain


def test_a_models_own_loss_under_another_name_equals_the_plain_model(ranks: dict[int, Any]) -> None:
    loss, plain = _plain(lambda m: m(*nano_batch())[1])
    ranks_equal_plain([ranks[r]["own"] for r in (0, 1)], loss, plain)


def test_a_summing_loss_fn_equals_the_plain_model(ranks: dict[int, Any]) -> None:
    idx, targets = nano_batch()
    loss, plain = _plain(lambda m: _summed(m(idx), targets))
    ranks_equal_plain([ranks[r]["summed"] for r in (0, 1)], loss, plain)


def test_contrastive_logits_are_refused_on_every_rank(ranks: dict[int, Any]) -> None:
    for r in (0, 1):
        assert "mixes rows of the batch" in ranks[r]["coupled"], ranks[r]["coupled"]
        assert all(ranks[r]["grads after refusal"])


def test_a_model_mixing_rows_is_refused_under_a_loss_fn_too(ranks: dict[int, Any]) -> None:
    for r in (0, 1):
        assert "mixes rows of the batch" in ranks[r]["coupled by loss_fn"], ranks[r]
