"""``pipe.step(..., scaler=)`` in one process: torch's AMP recipe (scale, unscale_, clip, step,
update) gives the plain model's losses, parameters and scale after every step, the first of
which overflows and is skipped; ``pipe(x)`` with ``scaler.scale(loss).backward()`` too."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from tests import _scaling as scaling

TOL = 1e-5


def _check(pipe_run: scaling.Record, plain_run: scaling.Record) -> None:
    # The first step overflowed and was skipped; the scale then grew every second good step.
    backed_off = scaling.INIT_SCALE * scaling.BACKOFF
    assert plain_run.scales == [backed_off, backed_off, 2 * backed_off, 2 * backed_off]
    assert pipe_run.scales == plain_run.scales
    gaps = scaling.differences(pipe_run, plain_run)
    assert gaps["losses"] < TOL and gaps["params"] < TOL, gaps
    first = pipe_run.params[0]  # skipped: the parameters as they were
    assert all(torch.equal(first[n], p) for n, p in scaling.tilted().named_parameters())


LAYOUTS = [{"balance": [2, 3]}, {"split": ["2"]}, {"split": [], "devices": ["cpu"]}]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_step_with_scaler_equals_plain(layout: dict[str, Any], schedule: str) -> None:
    """An nn.Sequential as a chain (balance) and through its own forward (split; one stage:
    plain autograd)."""
    x, y = scaling.tilted_batch()
    plain = scaling.tilted()
    pipe = pipepar.wrap(scaling.tilted(), chunks=4, schedule=schedule, **layout)
    chain = "balance" in layout

    def step(amp: torch.amp.GradScaler) -> Any:
        if chain:
            return pipe.step(x, y, nn.functional.mse_loss, scaler=amp)
        return pipe.step(x, target=y, loss_fn=nn.functional.mse_loss, scaler=amp)

    ours = scaling.train(pipe, step, pipe.clip_grad_norm_, scaling.scaler())
    theirs = scaling.train(
        plain, scaling.plain_step(plain, x, y), scaling.plain_clip(plain), scaling.scaler()
    )
    _check(ours, theirs)
    pipe.close()


@pytest.mark.parametrize("layout", [{"balance": [2, 3]}, {"split": ["2"]}])
def test_step_with_scaler_and_learned_shares_equals_plain(layout: dict[str, Any]) -> None:
    """A mean over the real targets, 4, 1, 0 and 3 in the micro-batches: each seed is a share
    learned at micro-batch 0's loss times the scale (by rows, or unscaled, it would differ)."""
    x, _ = scaling.tilted_batch(16)
    y = torch.tensor([0, 2, 1, 1, 2, -100, -100, -100, -100, -100, -100, -100, 0, 1, -100, 2])
    plain = scaling.tilted()
    pipe = pipepar.wrap(scaling.tilted(), chunks=4, **layout)
    loss_fn = nn.functional.cross_entropy

    def step(amp: torch.amp.GradScaler) -> Any:
        if "balance" in layout:
            return pipe.step(x, y, loss_fn, scaler=amp)
        return pipe.step(x, target=y, loss_fn=loss_fn, scaler=amp)

    ours = scaling.train(pipe, step, pipe.clip_grad_norm_, scaling.scaler())
    theirs = scaling.train(
        plain, scaling.plain_step(plain, x, y, loss_fn), scaling.plain_clip(plain), scaling.scaler()
    )
    _check(ours, theirs)
    pipe.close()


def test_call_then_scaled_backward_equals_plain() -> None:
    """``scaler.scale(loss).backward()`` on what ``pipe(x)`` returns."""
    x, y = scaling.tilted_batch()
    plain = scaling.tilted()
    pipe = pipepar.wrap(scaling.tilted(), balance=[2, 3], chunks=4)
    ours = scaling.train(
        pipe, scaling.plain_step(pipe, x, y), pipe.clip_grad_norm_, scaling.scaler()
    )
    theirs = scaling.train(
        plain, scaling.plain_step(plain, x, y), scaling.plain_clip(plain), scaling.scaler()
    )
    _check(ours, theirs)
    pipe.close()


@pytest.mark.parametrize("how", ["step", "call"])
def test_transformers_model_fp16_with_scaler_equals_plain(how: str) -> None:
    """GPT-2 (tied head, the model's own token loss over padded labels) under fp16 autocast,
    as AMP trains it: the first step's fp16 gradients overflow."""
    pytest.importorskip("transformers")
    plain, batch = scaling.fp16_gpt2()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["transformer.h.1"], chunks=3)
    pipe_step = scaling.fp16_pipe_step if how == "step" else scaling.fp16_step
    ours = scaling.train(
        pipe, pipe_step(pipe, batch), pipe.clip_grad_norm_, scaling.scaler(scaling.FP16_SCALE), 3
    )
    theirs = scaling.fp16_plain_run(plain, batch)
    scaling.check_fp16(ours, theirs)
    pipe.close()


def test_disabled_scaler_is_no_scaler() -> None:
    x, y = scaling.tilted_batch()
    pipe = pipepar.wrap(scaling.tilted(), balance=[2, 3], chunks=4)
    loss = pipe.step(x, y, nn.functional.mse_loss, scaler=torch.amp.GradScaler(enabled=False))
    grads = [p.grad.clone() for p in pipe.parameters()]
    pipe.zero_grad()
    assert pipe.step(x, y, nn.functional.mse_loss).item() == loss.item()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, pipe.parameters()))
    pipe.close()


@pytest.mark.parametrize("layout", [{"balance": [2, 3]}, {"split": ["2"]}])
def test_scaler_not_a_scaler(layout: dict[str, Any]) -> None:
    x, y = scaling.tilted_batch()
    pipe = pipepar.wrap(scaling.tilted(), chunks=2, **layout)
    with pytest.raises(TypeError, match=r"scaler must be a torch.amp.GradScaler.*got float"):
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss, scaler=1024.0)
    pipe.close()
