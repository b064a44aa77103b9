"""Micro-batches the caller made, ``pipe.step(microbatches=[...])``, across two gloo ranks: of
different rows and sequence lengths, an ``nn.Sequential`` (MSE, ``targets=``) and GPT-2 and
Llama with their own ``labels=`` loss (different ``-100`` counts, one micro-batch with none to
train on) give on every rank the loss and gradients of one loss over them all, under 1F1B and
a zero-bubble schedule, in training and evaluation; two replicas given micro-batches of their
own train as one batch of them all; ranks of a pipeline given different counts of micro-batches
are refused naming both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from models import transformers_zoo as zoo
from tests._ranks import spawn
from tests.program._given import chain, chain_data, hand_joined_lm, lm_batches
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow

MODELS = {"gpt2": ("transformer.h.2", "1f1b"), "llama": ("model.layers.2", "zb-h1")}


def _grads(pipe: Any) -> dict[str, Any]:
    return {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    out: dict[str, Any] = {}
    xs, ys = chain_data()
    pipe = ppd.wrap(chain(), balance=[3, 2], chunks=2, schedule="1f1b")
    for _ in range(2):  # the second step receives into the shapes learned by the first
        pipe.zero_grad()
        loss = pipe.step(microbatches=xs, targets=ys, loss_fn=F.mse_loss)
    out["chain"] = (loss, _grads(pipe))
    with torch.no_grad():
        out["chain eval"] = pipe.step(microbatches=xs, targets=ys, loss_fn=F.mse_loss)
    try:  # the last stage's rank was given fewer micro-batches than stage 0's
        mine = xs if rank == 0 else xs[:2]
        pipe.step(microbatches=mine, targets=ys[: len(mine)], loss_fn=F.mse_loss)
        out["counts differ"] = "no error"
    except Exception as err:
        out["counts differ"] = f"{type(err).__name__}: {err}"
    pipe.close()
    batches = lm_batches()
    for name, (split, schedule) in MODELS.items():
        torch.manual_seed(0)
        pipe = ppd.wrap(zoo.build(name), split=[split], chunks=2, schedule=schedule)
        for _ in range(2):  # the second follows the routes the first learned
            pipe.zero_grad()
            loss = pipe.step(microbatches=batches)
        out[name] = (loss, _grads(pipe))
        with torch.no_grad():
            out[f"{name} eval"] = pipe.step(microbatches=batches)
        pipe.close()
    torch.manual_seed(0)  # two replicas, each its own micro-batches (two and two)
    pipe = ppd.wrap(zoo.build("gpt2"), balance=[9], chunks=2, dp=2)
    out["replicas"] = (pipe.step(microbatches=batches[2 * rank : 2 * rank + 2]), _grads(pipe))
    pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def test_a_chain_over_micro_batches_of_other_lengths(ranks: dict[int, Any]) -> None:
    plain = chain()
    xs, ys = chain_data()
    squares = sum(((plain(x) - y) ** 2).sum() for x, y in zip(xs, ys))
    loss = squares / sum(y.numel() for y in ys)
    loss.backward()
    ranks_equal_plain([ranks[r]["chain"] for r in (0, 1)], loss, plain)
    for r in (0, 1):
        assert abs(ranks[r]["chain eval"] - loss.item()) <= 1e-5 * loss.item()
        assert "but stage 0's rank passed 3" in ranks[r]["counts differ"], ranks[r]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_models_own_loss_over_micro_batches_of_other_lengths(
    ranks: dict[int, Any], name: str
) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    loss = hand_joined_lm(plain, lm_batches())
    loss.backward()
    ranks_equal_plain([ranks[r][name] for r in (0, 1)], loss, plain)
    for r in (0, 1):
        assert abs(ranks[r][f"{name} eval"] - loss.item()) <= 1e-5 * loss.item()


def test_replicas_given_micro_batches_of_their_own(ranks: dict[int, Any]) -> None:
    """dp=2: the counts are summed over the replicas, so each replica's micro-batches of other
    lengths and token counts make the loss and gradients of one loss over all four."""
    torch.manual_seed(0)
    plain = zoo.build("gpt2")
    loss = hand_joined_lm(plain, lm_batches())
    loss.backward()
    for r in (0, 1):
        ranks_equal_plain([ranks[r]["replicas"]], loss, plain)
