"""Loss-scaled training as torch's AMP recipe writes it, on the plain model and on a pipe, with
a first step that overflows: what the one-process and the rank tests of ``scaler=`` share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "BACKOFF",
    "FP16_SCALE",
    "check_fp16",
    "fp16_gpt2",
    "fp16_pipe_step",
    "fp16_plain_run",
    "fp16_step",
    "INIT_SCALE",
    "Record",
    "differences",
    "plain_clip",
    "plain_step",
    "scaler",
    "tilted",
    "tilted_batch",
    "train",
]

INIT_SCALE = 2.0**125
"""Large enough that the first layer's scaled gradients (about 1e2) overflow float32 and the
others' (under 1) do not: the first step overflows on the first stage only."""
BACKOFF = 2.0**-20
"""One backoff brings the scale where nothing overflows."""
MAX_NORM = 1.0
LR = 1e-3


def tilted(seed: int = 0) -> nn.Sequential:
    """A small stack whose first layer's weights are 1e-3 of the usual and whose inputs
    (:func:`tilted_batch`) are 1e3 times: its activations are as usual, its weight gradients
    about 1e3 times the other layers'."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
    return model


def tilted_batch(rows: int = 8, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=gen) * 1e3, torch.randn(rows, 3, generator=gen)


def scaler(init_scale: float = INIT_SCALE) -> torch.amp.GradScaler:
    """A CPU scaler that grows every second good step and backs off by :data:`BACKOFF`."""
    return torch.amp.GradScaler(
        "cpu", init_scale=init_scale, backoff_factor=BACKOFF, growth_interval=2
    )


@dataclass
class Record:
    """What each step of :func:`train` left: the loss, the scale after ``update()`` and the
    parameters after ``scaler.step``."""

    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)


def train(
    model: nn.Module,
    step: Callable[[torch.amp.GradScaler], Any],
    clip: Callable[[float], Any],
    amp: torch.amp.GradScaler,
    steps: int = 4,
) -> Record:
    """``steps`` steps of SGD the AMP way: ``step(scaler)`` runs the scaled backward and
    returns the loss, then ``unscale_``, ``clip(max_norm)``, ``scaler.step``, ``update``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    record = Record()
    for _ in range(steps):
        loss = step(amp)
        amp.unscale_(opt)
        clip(MAX_NORM)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        record.losses.append(float(loss))
        record.scales.append(amp.get_scale())
        record.params.append({n: _whole(p) for n, p in model.named_parameters()})
    return record


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A copy of ``p``'s values (all of them, for a shard of a sharded replica)."""
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def plain_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[Any, Any], torch.Tensor] = nn.functional.mse_loss,
) -> Callable[[torch.amp.GradScaler], Any]:
    """The plain model's scaled step on the whole batch."""

    def step(amp: torch.amp.GradScaler) -> Any:
        loss = loss_fn(model(x), y)
        amp.scale(loss).backward()
        return loss.detach()

    return step


def plain_clip(model: nn.Module) -> Callable[[float], Any]:
    return lambda max_norm: nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def differences(ours: Record, theirs: Record) -> dict[str, float]:
    """The largest difference of the losses and of any parameter after any step."""
    params = max(
        (a[n] - b[n]).abs().max().item()
        for a, b in zip(ours.params, theirs.params)
        for n in a
    )
    losses = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
    return {"losses": losses, "params": params}


# -- fp16: GPT-2 under autocast -----------------------------------------------------------
FP16_SCALE = 2.0**30
"""Under fp16 autocast, GPT-2's scaled activation gradients pass fp16's largest value (65504)."""
FP16_TOL = 2e-3
"""Micro-batches round fp16 products differently from the whole batch."""


def fp16_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small GPT-2 (tied head) and a padded batch for its own token loss."""
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    return zoo.gpt2(layers=2, hidden=16), zoo.padded_sample("gpt2", batch=6, seq=8)


def fp16_step(model: nn.Module, batch: dict[str, Any]) -> Callable[[torch.amp.GradScaler], Any]:
    """The model's loss under fp16 autocast, its scaled backward outside, as AMP does."""

    def step(amp: torch.amp.GradScaler) -> Any:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        amp.scale(loss).backward()
        return loss.detach()

    return step


def fp16_pipe_step(pipe: Any, batch: dict[str, Any]) -> Callable[[torch.amp.GradScaler], Any]:
    """``pipe.step(**batch, scaler=)`` under fp16 autocast."""

    def step(amp: torch.amp.GradScaler) -> Any:
        with torch.autocast("cpu", dtype=torch.float16):
            return pipe.step(**batch, scaler=amp)

    return step


def fp16_plain_run(plain: nn.Module, batch: dict[str, Any]) -> Record:
    return train(plain, fp16_step(plain, batch), plain_clip(plain), scaler(FP16_SCALE), 3)


def check_fp16(ours: Record, theirs: Record) -> None:
    """The first step overflowed and was skipped on both, the scale grew after two good steps,
    and the losses and parameters are the plain model's within fp16's rounding."""
    backed_off = FP16_SCALE * BACKOFF
    assert theirs.scales == [backed_off, backed_off, 2 * backed_off]
    assert ours.scales == theirs.scales
    gaps = differences(ours, theirs)
    assert gaps["losses"] < FP16_TOL and gaps["params"] < FP16_TOL, gaps
