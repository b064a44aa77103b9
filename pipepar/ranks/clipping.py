"""Gradient clipping over a model split across ranks: the whole model's norm, clipped alike.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` on a rank sees only that rank's
stage, so every stage would clip by its own factor. Here each rank computes its part of the
norm (``sum |g|^p``, or ``max |g|`` for the infinity norm) over the gradients it owns, the parts
are reduced over the ranks of the pipeline, and every rank scales its gradients by the same
factor. A weight tied across stages is counted once (by the first stage that uses it); data-
parallel replicas hold the same averaged gradients, so they are counted once too (the
reduction spans one pipeline, not the replicas). Sharded replicas (``DTensor`` gradients, each
replica a shard) add their shards' parts over the replicas first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from pipepar.ranks.mesh import Mesh
from pipepar.ranks.sharding import is_dtensor

__all__ = ["clip_grad_norm_", "local_values"]


def clip_grad_norm_(
    owned: Iterable[Tensor],
    scaled: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    mesh: Mesh,
    device: torch.device,
    sharded: bool = False,
) -> Tensor:
    """Clip like ``torch.nn.utils.clip_grad_norm_`` on the plain model; return its total norm.

    Args:
        owned: the parameters whose gradients this rank counts in the norm.
        scaled: the parameters whose gradients this rank scales (its own, tied copies too).
        max_norm: the largest norm allowed.
        norm_type: ``p`` of the p-norm, ``inf`` for the largest absolute value.
        error_if_nonfinite: raise if the total norm is ``nan`` or ``inf``.
        mesh: this rank's grid (the norm is reduced over its pipeline's ranks, waiting at most
            the pipe's timeout).
        device: where this rank computes.
        sharded: the gradients are ``DTensor`` shards over the replicas of ``mesh``: each
            counts its own rows, and the parts are reduced over the replicas too.

    Raises:
        RuntimeError: the total norm is not finite and ``error_if_nonfinite`` is set.
    """
    p = float(norm_type)
    part = _local_part([local_values(q.grad) for q in owned if q.grad is not None], p, device)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    if sharded and mesh.dp_group is not None:
        mesh.progress.all_reduce(part, mesh.dp_group, "the gradient norm of the shards", op)
    if mesh.ctl is not None:
        mesh.progress.all_reduce(part, mesh.ctl, "the gradient norm", op)
    total = part if math.isinf(p) else part.pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is non-finite, so they cannot be "
            "clipped; pass error_if_nonfinite=False to clip them anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for q in scaled:
            if q.grad is not None:
                q.grad.mul_(coef.to(q.grad.device))
    return total


def local_values(g: Tensor) -> Tensor:
    """This rank's own values of ``g`` (its shard, for a ``DTensor``)."""
    return g.to_local() if is_dtensor(g) else g


def _local_part(grads: list[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |g|^p`` over this rank's gradients (``max |g|`` for the infinity norm)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, p).float().to(device) for g in grads])
    return norms.max() if math.isinf(p) else norms.pow(p).sum()
