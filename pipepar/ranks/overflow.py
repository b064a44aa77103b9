"""Every rank of the grid skips a loss-scaled step together.

A loss scaler decides per optimizer: ``scaler.unscale_(opt)`` finds an ``inf`` or ``nan`` in the
gradients of ``opt``'s parameters, ``scaler.step(opt)`` then skips ``opt.step()``, and
``scaler.update()`` lowers the scale. The plain model has one optimizer over every weight. Over
the ranks each rank's optimizer holds its own stages' weights (a shard of them with
``dp_shard``), so a gradient that overflows on one stage would make that rank skip while the
others step, and their scales drift apart.

After a scaled step every rank therefore reduces "did any of my gradients overflow" over its
pipeline and over its replicas (the maximum), and a rank whose own gradients are finite while
another rank's are not marks its gradients as overflowed too (one value set to ``inf``): the
scaler of every rank then finds what the plain model's scaler finds on the whole model, and all
of them skip the step and lower their scale together. The same reduction checks that every
rank scaled by the same factor. Nothing here calls the scaler or the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from pipepar.core.loss_scale import overflowed
from pipepar.ranks.clipping import local_values
from pipepar.ranks.mesh import Mesh

__all__ = ["agree_overflow"]


def agree_overflow(
    params: Iterable[Tensor], scale: float, *, mesh: Mesh, device: torch.device
) -> bool:
    """Make every rank's gradients overflowed if any rank's are; return whether they are.

    Call it on every rank of the grid after a step scaled by ``scale``.

    Args:
        params: the parameters this rank holds (their ``.grad``; a shard's own values).
        scale: the loss scale this rank's step used.
        mesh: this rank's grid: the reduction spans its pipeline and its replicas.
        device: where this rank computes.

    Raises:
        ValueError: the ranks scaled by different factors.
    """
    grads = [local_values(p.grad) for p in params if p.grad is not None]
    mine = overflowed(grads, device)
    # One reduction for both questions: the largest flag, the largest and the smallest scale.
    agreed = torch.stack([mine, *torch.tensor([scale, -scale], device=device)])
    for group, what in ((mesh.ctl, "the pipeline"), (mesh.dp_group, "the replicas")):
        if group is not None:
            name = f"whether a gradient overflowed over {what}"
            mesh.progress.all_reduce(agreed, group, name, dist.ReduceOp.MAX)
    found, largest, smallest = (float(v) for v in agreed.tolist())
    if largest != -smallest:
        raise ValueError(
            f"the loss scaler's scale differs over the ranks ({-smallest} to {largest}, "
            f"{scale} on this rank); build every rank's GradScaler with the same arguments "
            "and pass it to every step"
        )
    target = next((g for g in grads if g.numel()), None)
    if found and not bool(mine) and target is not None:
        with torch.no_grad():
            target[(0,) * target.dim()] = float("inf")
    return bool(found)
