"""Evaluation with ``ModelPipe.step`` under ``torch.no_grad()`` / ``torch.inference_mode()``:
the forwards only, the plain model's loss in eval mode (the model's own token loss over padded
labels, a count passed as ``num_items_in_batch``, ``loss_fn`` with ``ignore_index`` or
``items=``), no ``.grad`` and no autograd graph; a training step after an evaluation is the
training step without it."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from models import transformers_zoo as zoo

pytest.importorskip("transformers")

RTOL = 1e-5
NO_GRAD = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _gpt2_pair(schedule: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = zoo.gpt2(dropout=0.3)  # eval mode must turn it off
    pipe = pipepar.wrap(
        copy.deepcopy(plain),
        split=["transformer.h.2"],
        devices=["cpu", "cpu"],
        chunks=3,
        schedule=schedule,
    )
    return plain, pipe


def _no_graph(pipe: nn.Module) -> list[bool]:
    """Record, for every block of the model, whether it ran with gradients enabled."""
    seen: list[bool] = []
    for block in pipe.transformer.h:
        block.register_forward_hook(lambda m, a, out: seen.append(torch.is_grad_enabled()))
    return seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("count", [False, True])
@pytest.mark.parametrize("mode", list(NO_GRAD))
def test_the_models_own_loss_under_no_grad_is_the_plain_eval_loss(
    schedule: str, count: bool, mode: str
) -> None:
    plain, pipe = _gpt2_pair(schedule)
    plain.eval(), pipe.eval()
    batch = zoo.padded_sample("gpt2")
    if count:  # HF Trainer passes the count of its whole (accumulated) batch
        batch["num_items_in_batch"] = torch.tensor(23)
    with torch.no_grad():
        expected = plain(**batch).loss
    seen = _no_graph(pipe)
    with NO_GRAD[mode]():
        got = pipe.step(**batch)
    assert abs(got.item() - expected.item()) <= RTOL * abs(expected.item())
    assert not got.requires_grad
    assert seen and not any(seen), "a stage built an autograd graph during evaluation"
    assert all(p.grad is None for p in pipe.parameters())


def _logits_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())  # type: ignore[attr-defined]


def test_cross_entropy_with_ignore_index_under_no_grad_is_the_plain_eval_loss() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 5)).eval()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["3"], devices=["cpu", "cpu"], chunks=4)
    pipe.eval()
    x = torch.randn(11, 6)
    y = torch.tensor([1, 3, 3, 3, 3, 3, 3, 4, 0, 3, 2])  # 3 is ignored: rows 3-5 have none
    fn = functools.partial(F.cross_entropy, ignore_index=3)
    with torch.no_grad():
        got, expected = pipe.step(x, loss_fn=fn, target=y), fn(plain(x), y)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-7)
    assert all(p.grad is None for p in pipe.parameters())


def test_a_loss_fn_counting_its_items_under_no_grad_is_the_plain_eval_loss() -> None:
    plain, pipe = _gpt2_pair("1f1b")
    plain.eval(), pipe.eval()
    batch = zoo.padded_sample("gpt2")
    labels = batch.pop("labels")
    with torch.no_grad():
        got = pipe.step(
            **batch, loss_fn=_logits_loss, target=labels, items=lambda y: (y[:, 1:] != -100).sum()
        )
        expected = _logits_loss(plain(**batch), labels)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-7)
    assert all(p.grad is None for p in pipe.parameters())


def test_evaluation_between_training_steps_changes_nothing() -> None:
    """Train, validate, train on the validation batch (dropout on while training): losses and
    gradients are those of the two training steps alone."""
    batch, val = zoo.padded_sample("gpt2", seed=1), zoo.padded_sample("gpt2", seed=2)
    results = []
    for validate in (True, False):
        _, pipe = _gpt2_pair("1f1b")
        torch.manual_seed(5)
        losses = [pipe.step(**batch)]
        if validate:
            before = [p.grad.clone() for p in pipe.parameters()]
            with torch.no_grad():
                pipe.eval().step(**val)
            pipe.train()
            assert all(torch.equal(b, p.grad) for b, p in zip(before, pipe.parameters()))
        losses.append(pipe.step(**val))
        results.append((losses, [p.grad for p in pipe.parameters()]))
    (got, got_grads), (ref, ref_grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_calling_the_pipe_under_no_grad_still_returns_the_models_output() -> None:
    plain, pipe = _gpt2_pair("1f1b")
    plain.eval(), pipe.eval()
    batch = zoo.padded_sample("gpt2")
    with torch.no_grad():
        out, expected = pipe(**batch), plain(**batch)
    assert not out.logits.requires_grad
    torch.testing.assert_close(out.logits, expected.logits, rtol=RTOL, atol=1e-6)
    assert abs(out.loss.item() - expected.loss.item()) <= RTOL * expected.loss.item()
