"""A loss scaler's scale in a step that runs its own backward.

With the plain model, mixed-precision training scales the loss before its backward
(``scaler.scale(loss).backward()``), so small fp16 gradients do not flush to zero, and the
scaler then unscales them, skips the optimizer step if one overflowed and adjusts its scale.
``pipe.step`` runs the backward itself, each micro-batch's from its loss with the micro-batch's
share of the batch as the seed (:mod:`pipepar.core.losses`). Scaling the loss by ``S`` is
multiplying every seed by ``S``: the gradients become ``S`` times the unscaled ones, as the
plain model's do. Everything after the step (``scaler.unscale_``, clipping, ``scaler.step``,
``scaler.update``) is the scaler's own, unchanged.

This module reads the scale (:func:`loss_scale`) and tells whether gradients overflowed
(:func:`overflowed`); it never calls the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["LossScaler", "check_scaler", "loss_scale", "overflowed"]


@runtime_checkable
class LossScaler(Protocol):
    """What ``pipe.step(..., scaler=)`` uses of a scaler: ``torch.amp.GradScaler`` or one
    like it (e.g. FSDP's ``ShardedGradScaler``)."""

    def scale(self, outputs: Any) -> Any: ...

    def unscale_(self, optimizer: Any) -> None: ...

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any: ...

    def update(self, new_scale: Any = None) -> None: ...

    def is_enabled(self) -> bool: ...


def check_scaler(scaler: Any) -> LossScaler:
    """``scaler`` if it is a loss scaler, else a TypeError naming what it lacks."""
    if not isinstance(scaler, LossScaler):
        missing = [
            name
            for name in ("scale", "unscale_", "step", "update", "is_enabled")
            if not callable(getattr(scaler, name, None))
        ]
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or one like it), but got "
            f"{type(scaler).__name__} without {', '.join(missing)}; pass "
            'scaler=torch.amp.GradScaler("cuda") (or "cpu"), or leave it out'
        )
    return scaler


def loss_scale(scaler: Any, device: torch.device) -> float:
    """The factor every micro-batch's backward seed is multiplied by: the scaler's current
    scale (1.0 without a scaler, or with a disabled one).

    It is read through ``scaler.scale`` on ``device`` (where the loss is), as the plain model's
    ``scaler.scale(loss)`` reads it, so a fresh scaler makes its scale there too and a later
    ``scaler.unscale_`` finds it.

    Raises:
        TypeError: ``scaler`` is not a loss scaler.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> loss_scale(scaler, torch.device("cpu"))
        1024.0
    """
    if scaler is None:
        return 1.0
    scaler = check_scaler(scaler)
    if not scaler.is_enabled():
        return 1.0
    one = torch.ones((), dtype=torch.float32, device=device)
    return float(scaler.scale(one).reshape(()).item())


def overflowed(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """1.0 (on ``device``) if any of ``grads`` holds an ``inf`` or ``nan``, else 0.0: what the
    scaler's ``unscale_`` finds. Each gradient's largest absolute value is finite exactly when
    the gradient is, and unlike a sum it cannot overflow from finite values.

    Example:
        >>> overflowed([torch.ones(2), torch.tensor([1.0, float("inf")])], torch.device("cpu"))
        tensor(1.)
    """
    if not grads:
        return torch.zeros((), device=device)
    peaks = torch.stack(
        [torch.linalg.vector_norm(g, float("inf")).float().to(device) for g in grads]
    )
    return (~torch.isfinite(peaks)).any().float()
