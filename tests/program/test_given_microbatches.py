"""Micro-batches the caller made, ``pipe.step(microbatches=[...], targets=[...])``, in one
process: of different rows and sequence lengths, they give the loss and gradients of one loss
over all of them (the plain model's per-micro-batch values joined by hand), for an
``nn.Sequential`` and for transformers models with their own ``labels=`` loss, under GPipe,
1F1B and a zero-bubble schedule; bad arguments are refused naming them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pipepar
from models import transformers_zoo as zoo
from pipepar.core.losses import LossNotJoinable
from pipepar.core.named_schedules import make
from pipepar.core.schedule import Schedule
from tests._foreign_models import NanoGPT
from tests.program._given import SHAPES, chain, chain_data, hand_joined_lm, lm_batches

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
SPLITS = {"gpt2": "transformer.h.2", "llama": "model.layers.2"}
RTOL = 1e-5


def _check_grads(pipe: nn.Module, plain: nn.Module) -> None:
    theirs = dict(plain.named_parameters())
    scale = max(p.grad.abs().max().item() for p in plain.parameters() if p.grad is not None)
    for name, p in pipe.named_parameters():
        ref = theirs[name].grad
        assert p.grad is not None and ref is not None, name
        err = ((p.grad - ref).abs().max() / scale).item()
        assert err < RTOL, f"{name}: relative error {err:.2e}"


def _close(a: Tensor | float, b: Tensor) -> bool:
    return abs(float(a) - b.item()) <= RTOL * abs(b.item())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_chains_micro_batches_of_other_lengths_equal_one_loss_over_them(schedule: str) -> None:
    plain = chain()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), balance=[3, 2], devices=["cpu", "cpu"], chunks=2, schedule=schedule
    )
    xs, ys = chain_data()
    pipe.step(microbatches=xs, targets=ys, loss_fn=F.mse_loss)  # learns, then follows
    pipe.zero_grad()
    loss = pipe.step(microbatches=xs, targets=ys, loss_fn=F.mse_loss)
    squares = sum(((plain(x) - y) ** 2).sum() for x, y in zip(xs, ys))
    ref = squares / sum(y.numel() for y in ys)
    ref.backward()
    assert _close(loss, ref), (loss, ref)
    _check_grads(pipe, plain)
    with torch.no_grad():  # evaluation: the same loss, .grad untouched
        before = [p.grad.clone() for p in pipe.parameters()]
        assert _close(pipe.step(microbatches=xs, targets=ys, loss_fn=F.mse_loss), ref)
    assert all(torch.equal(p.grad, b) for p, b in zip(pipe.parameters(), before))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_models_own_loss_over_micro_batches_of_other_lengths(name: str, schedule: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    pipe = pipepar.wrap(
        copy.deepcopy(plain),
        split=[SPLITS[name]],
        devices=["cpu", "cpu"],
        chunks=2,
        schedule=schedule,
    )
    batches = lm_batches()
    pipe.step(microbatches=batches)
    pipe.zero_grad()
    loss = pipe.step(microbatches=batches)  # the schedule built for 4, chunks=2 or not
    ref = hand_joined_lm(plain, batches)
    ref.backward()
    assert _close(loss, ref), (loss, ref)
    _check_grads(pipe, plain)
    with torch.no_grad():
        assert _close(pipe.step(microbatches=batches), ref)


def test_a_loss_fn_with_targets_and_positional_micro_batches() -> None:
    """nanoGPT's ``forward(idx, targets)``: micro-batches as tuples; its own loss, a loss_fn
    with ``targets=``, and its own ``targets=`` keyword still the model's without
    ``microbatches=``."""
    torch.manual_seed(0)
    plain = NanoGPT()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["h.2"], devices=["cpu", "cpu"], chunks=2)
    g = torch.Generator().manual_seed(3)
    idx = [torch.randint(0, 11, (r, t), generator=g) for r, t in SHAPES]
    tgt = [torch.randint(0, 11, (r, t), generator=g) for r, t in SHAPES]
    tgt[0][:, 3:] = -1

    def loss_fn(output: Any, target: Tensor) -> Tensor:
        logits = output[0]
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1)

    def hand_joined(model: nn.Module) -> Tensor:
        total = sum(
            F.cross_entropy(
                model(i)[0].flatten(0, 1), t.flatten(), ignore_index=-1, reduction="sum"
            )
            for i, t in zip(idx, tgt)
        )
        return total / sum(int((t != -1).sum()) for t in tgt)

    ref = hand_joined(plain)
    ref.backward()
    for how in ("loss_fn", "own"):
        pipe.zero_grad()
        if how == "loss_fn":
            loss = pipe.step(microbatches=[(i,) for i in idx], targets=tgt, loss_fn=loss_fn)
        else:
            loss = pipe.step(microbatches=list(zip(idx, tgt)))
        assert _close(loss, ref), (how, loss, ref)
        _check_grads(pipe, plain)
    whole = torch.randint(0, 11, (4, 6), generator=g)
    own = plain(whole, targets=whole)[1]
    assert _close(pipe.step(whole, targets=whole), own)  # the model's keyword, split by rows


def test_a_mean_measured_on_micro_batch_0_is_refused_for_other_lengths() -> None:
    """A hand-written mean over the output's elements: its count is the first micro-batch's,
    scaled by rows, which is wrong for other sequence lengths: refused before any gradient."""
    plain = chain()
    pipe = pipepar.wrap(copy.deepcopy(plain), balance=[3, 2], devices=["cpu", "cpu"], chunks=2)
    xs, ys = chain_data()
    with pytest.raises(LossNotJoinable, match="differ in shape beyond their rows"):
        pipe.step(microbatches=xs, targets=ys, loss_fn=lambda o, y: ((o - y) ** 2).mean())
    with pytest.raises(LossNotJoinable, match="means over different counts added"):
        pipe.step(  # per element plus per row: in proportion only for equal lengths
            microbatches=xs,
            targets=ys,
            loss_fn=lambda o, y: F.mse_loss(o, y) + F.l1_loss(o.sum(1), y.sum(1)),
        )
    assert all(p.grad is None for p in pipe.parameters())
    same = [torch.randn(2, 5, 4), torch.randn(3, 5, 4)]  # only rows differ: exact, accepted
    targets = [torch.randn(2, 5, 2), torch.randn(3, 5, 2)]
    loss = pipe.step(microbatches=same, targets=targets, loss_fn=lambda o, y: ((o - y) ** 2).mean())
    ref = ((plain(torch.cat(same)) - torch.cat(targets)) ** 2).mean()
    ref.backward()
    assert _close(loss, ref), (loss, ref)
    _check_grads(pipe, plain)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"microbatches": (torch.zeros(2, 4),)}, TypeError, "microbatches must be a list"),
        ({"microbatches": []}, ValueError, "microbatches is an empty list"),
        (
            {"microbatches": [torch.zeros(2, 4)], "target": torch.zeros(2, 2)},
            TypeError,
            "targets=\\[...\\]",
        ),
        (
            {"microbatches": [torch.zeros(2, 4)], "targets": [torch.zeros(2, 2)]},
            TypeError,
            "targets= without loss_fn=",
        ),
        (
            {
                "microbatches": [torch.zeros(2, 4)],
                "targets": [torch.zeros(2, 2)] * 2,
                "loss_fn": F.mse_loss,
            },
            ValueError,
            "targets has 2 entries but microbatches has 1",
        ),
        (
            {
                "microbatches": [torch.zeros(2, 4)],
                "targets": torch.zeros(2, 2),
                "loss_fn": F.mse_loss,
            },
            TypeError,
            "targets must be a list",
        ),
    ],
)
def test_bad_micro_batch_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    pipe = pipepar.wrap(chain(), balance=[3, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(error, match=match):
        pipe.step(**kwargs)


def test_micro_batches_with_the_batch_or_other_arguments_are_refused() -> None:
    torch.manual_seed(0)
    pipe = pipepar.wrap(zoo.build("gpt2"), split=["transformer.h.2"], devices=["cpu", "cpu"])
    ids = torch.randint(1, 50, (2, 5))
    with pytest.raises(TypeError, match="microbatches= and the batch's own arguments"):
        pipe.step(input_ids=ids, microbatches=[{"input_ids": ids, "labels": ids}])
    with pytest.raises(ValueError, match=r"microbatches\[1\] passes the model"):
        pipe.step(microbatches=[{"input_ids": ids, "labels": ids}, {"input_ids": ids}])
    built = make("1f1b", 2, 4, n_workers=2)
    fixed = Schedule("mine", built.n_stages, built.n_microbatches, built.actions)
    fixed_pipe = pipepar.wrap(
        chain(), balance=[3, 2], devices=["cpu", "cpu"], chunks=4, schedule=fixed
    )
    with pytest.raises(ValueError, match="4 microbatches="):
        fixed_pipe.step(microbatches=[torch.zeros(2, 4)] * 3, loss_fn=lambda o, y: o.sum())
