"""``pipe.step(..., scaler=)`` across ranks: torch's AMP recipe (scale, unscale_, clip, step,
update) on every rank gives the plain model's losses, parameters and scale after every step.
The first step's gradients overflow on the first stage only: every rank (every stage, every
replica) skips it and backs off its scale, as the plain model's one scaler does."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from pipepar.core.losses import LossFn
from tests import _scaling as scaling
from tests._ranks import spawn

pytestmark = pytest.mark.slow

TOL = 1e-5


def _train_pipe(
    pipe: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    chain: bool,
    loss_fn: LossFn = nn.functional.mse_loss,
) -> scaling.Record:
    first = pipe.stage_index == 0

    def step(amp: torch.amp.GradScaler) -> Any:
        if chain:  # stage 0 reads x, the last stage the target
            return pipe.step(x if first else None, y, loss_fn, scaler=amp)
        return pipe.step(x, target=y, loss_fn=loss_fn, scaler=amp)

    return scaling.train(pipe, step, pipe.clip_grad_norm_, scaling.scaler())


def _plain(
    x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = nn.functional.mse_loss
) -> scaling.Record:
    plain = scaling.tilted()
    step = scaling.plain_step(plain, x, y, loss_fn)
    return scaling.train(plain, step, scaling.plain_clip(plain), scaling.scaler())


def _report(ours: scaling.Record, theirs: scaling.Record) -> dict[str, Any]:
    return {
        "scales": ours.scales,
        "plain_scales": theirs.scales,
        "gaps": scaling.differences(ours, theirs),
        "params": len(ours.params[0]),
    }


def _pipeline(rank: int) -> dict[str, Any]:
    """pp=2: an nn.Sequential as a chain and through its own forward; GPT-2 under fp16
    autocast (checked on the rank); scalers built differently on the ranks."""
    import pipepar.distributed as ppd

    x, y = scaling.tilted_batch()
    theirs = _plain(x, y)
    out = {}
    for how, layout in (("chain", {"balance": [2, 3]}), ("program", {"split": ["2"]})):
        pipe = ppd.wrap(scaling.tilted(), chunks=4, schedule="1f1b", **layout)
        out[how] = _report(_train_pipe(pipe, x, y, how == "chain"), theirs)
        pipe.close()
    plain, batch = scaling.fp16_gpt2()  # the model's own loss under fp16 autocast
    pipe = ppd.wrap(copy.deepcopy(plain), split=["transformer.h.1"], chunks=3)
    amp = scaling.scaler(scaling.FP16_SCALE)
    ours = scaling.train(pipe, scaling.fp16_pipe_step(pipe, batch), pipe.clip_grad_norm_, amp, 3)
    scaling.check_fp16(ours, scaling.fp16_plain_run(plain, batch))
    pipe.close()
    pipe = ppd.wrap(scaling.tilted(), balance=[2, 3], chunks=4)
    amp = scaling.scaler(2.0**10 * (rank + 1))  # built with other arguments on each rank
    try:
        pipe.step(x if rank == 0 else None, y, nn.functional.mse_loss, scaler=amp)
        out["scales_differ"] = "no error"
    except Exception as e:  # the error itself is what is checked
        out["scales_differ"] = f"{type(e).__name__}: {e}"
    pipe.close()
    return out


MASKED = torch.tensor([0, 2, 1, 1, 2, -100, -100, -100, -100, -100, -100, 0, 1, -100, 2, -100])
"""Class targets with 5 real ones in replica 0's half, 3 in replica 1's, none in one
micro-batch: a mean over the real targets of both replicas, learned at micro-batch 0's loss."""


def _replicated(rank: int, shard: bool) -> dict[str, Any]:
    """pp=2 x dp=2: each replica its half of the batch, the plain model all of it; a mean
    over rows and one over the real targets."""
    import pipepar.distributed as ppd

    x, y = scaling.tilted_batch(rows=16)
    out = {}
    for name, loss_fn, target in (
        ("mse", nn.functional.mse_loss, y),
        ("masked", nn.functional.cross_entropy, MASKED),
    ):
        theirs = _plain(x, target, loss_fn)
        pipe = ppd.wrap(scaling.tilted(), balance=[2, 3], chunks=4, dp=2, dp_shard=shard)
        rows = slice(8 * pipe.dp_rank, 8 * pipe.dp_rank + 8)
        ours = _train_pipe(pipe, x[rows], target[rows], chain=True, loss_fn=loss_fn)
        out[name] = _report(ours, theirs)
        pipe.close()
    return out


def _check(report: dict[str, Any]) -> None:
    backed_off = scaling.INIT_SCALE * scaling.BACKOFF
    assert report["plain_scales"] == [backed_off, backed_off, 2 * backed_off, 2 * backed_off]
    assert report["scales"] == report["plain_scales"]
    assert report["params"] > 0
    gaps = report["gaps"]
    assert gaps["losses"] < TOL and gaps["params"] < TOL, gaps


def test_every_stage_skips_an_overflowed_step_together() -> None:
    results = spawn(2, _pipeline)
    for out in results.values():
        for how in ("chain", "program"):
            _check(out[how])
        assert "the loss scaler's scale differs over the ranks (1024.0 to 2048.0" in (
            out["scales_differ"]
        )


@pytest.mark.parametrize("shard", [False, True])
def test_every_replica_skips_an_overflowed_step_together(shard: bool) -> None:
    results = spawn(4, functools.partial(_replicated, shard=shard))
    for out in results.values():
        _check(out["mse"])
        _check(out["masked"])
