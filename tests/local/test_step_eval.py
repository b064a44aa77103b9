"""Evaluation with ``Pipe.step`` under ``torch.no_grad()`` / ``torch.inference_mode()``: only
the forwards run, the loss is the plain model's in eval mode (dropout off), ``.grad`` is never
touched and no stage builds an autograd graph; a training step after an evaluation is the
training step without it (a loop that validates between optimizer steps)."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.core.named_schedules import VIRTUAL

TARGETS = torch.tensor([1, -100, -100, -100, -100, 3, -100, 4, 0, -100, -100])  # 11 rows
NO_GRAD = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5)
    )


def _pipe(model: nn.Sequential, schedule: str) -> Any:
    balance = [2, 2, 1, 1] if schedule in VIRTUAL else [3, 3]
    return pipepar.wrap(model, balance, devices=["cpu", "cpu"], chunks=4, schedule=schedule)


@contextlib.contextmanager
def _graphs_built(model: nn.Module) -> Iterator[list[bool]]:
    """Whether any layer ran with gradients enabled or returned a tensor needing one (the
    hooks run on the stage's worker thread, where the layer computes)."""
    seen: list[bool] = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen.append(torch.is_grad_enabled() or out.requires_grad)

    handles = [m.register_forward_hook(hook) for m in model]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


LOSSES: dict[str, tuple[Callable[..., torch.Tensor], torch.Tensor, dict[str, Any]]] = {
    "cross_entropy": (F.cross_entropy, TARGETS, {}),
    "ignore_index": (  # 3 marks what is ignored: most rows, and micro-batches with no target
        functools.partial(F.cross_entropy, ignore_index=3),
        torch.where(TARGETS < 0, 3, TARGETS),
        {},
    ),
    "mse": (lambda out, y: F.mse_loss(out[:, 0], y.float()), TARGETS, {}),
    "items": (
        lambda out, y: F.cross_entropy(out, y, reduction="sum") / max(int((y >= 0).sum()), 1),
        TARGETS,
        {"items": lambda y: (y >= 0).sum()},
    ),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-v"])
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", list(NO_GRAD))
def test_step_under_no_grad_gives_the_plain_eval_loss(schedule: str, loss: str, mode: str) -> None:
    loss_fn, y, options = LOSSES[loss]
    plain = _model().eval()
    pipe = _pipe(copy.deepcopy(plain), schedule).eval()
    x = torch.randn(len(y), 6)
    expected = loss_fn(plain(x), y)
    with NO_GRAD[mode](), _graphs_built(pipe) as seen:
        got = pipe.step(x, y, loss_fn, **options)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-7)
    assert not got.requires_grad
    assert seen and not any(seen), "a stage built an autograd graph during evaluation"
    assert all(p.grad is None for p in pipe.parameters())


def test_evaluation_leaves_gradients_alone_and_the_next_step_unchanged() -> None:
    """Train, validate, train on the validation batch: the gradients and losses are those of
    the two training steps alone, and the random draws of training are untouched."""
    x, x_val = torch.randn(11, 6), torch.randn(11, 6)
    results = []
    for validate in (True, False):
        pipe = _pipe(_model(), "1f1b")
        torch.manual_seed(1)
        losses = [pipe.step(x, TARGETS, F.cross_entropy)]
        before = [p.grad.clone() for p in pipe.parameters()]
        if validate:
            with torch.no_grad():
                pipe.eval().step(x_val, TARGETS, F.cross_entropy)
            pipe.train()
            for b, p in zip(before, pipe.parameters()):
                assert torch.equal(b, p.grad), "evaluation changed .grad"
        losses.append(pipe.step(x_val, TARGETS, F.cross_entropy))
        results.append((losses, [p.grad for p in pipe.parameters()]))
    (got, got_grads), (ref, ref_grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_calling_the_pipe_under_no_grad_still_returns_the_output() -> None:
    plain = _model().eval()
    pipe = _pipe(copy.deepcopy(plain), "1f1b").eval()
    x = torch.randn(11, 6)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, plain(x).detach(), rtol=1e-5, atol=1e-7)


def test_an_evaluation_leaves_the_random_generator_as_the_plain_model_does() -> None:
    pipe = _pipe(_model(), "1f1b")
    x = torch.randn(11, 6)
    pipe.step(x, TARGETS, F.cross_entropy)  # training: the stages' streams drew (dropout)
    pipe.eval()
    for _ in range(2):  # the first evaluation in eval mode, and a later one
        before = torch.get_rng_state()
        with torch.no_grad():
            pipe.step(x, TARGETS, F.cross_entropy)
        assert torch.equal(torch.get_rng_state(), before)
