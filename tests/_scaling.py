"""Loss-scaled training as torch's AMP recipe writes it, on the plain model and on a pipe, with
a first step that overflows: what the one-process and the rank tests of ``scaler=`` share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "BACKOFF",
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
        record.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return record


def plain_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[torch.amp.GradScaler], Any]:
    """The plain model's scaled step on the whole batch."""

    def step(amp: torch.amp.GradScaler) -> Any:
        loss = nn.functional.mse_loss(model(x), y)
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
