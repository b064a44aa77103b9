"""The pp x dp grid of ranks: where this rank sits and the process groups it talks on.

Ranks of the parent group (the world by default) are laid out replica by replica: group rank
``g`` runs stage ``g % pp`` of replica ``g // pp``. A pipeline replica is thus a run of ``pp``
consecutive ranks (neighbouring stages share a host under torchrun when ``pp`` divides the
processes per node), and the ``dp`` copies of one stage are ``pp`` ranks apart.

Each rank joins four small groups, all created with local synchronization so only members take
part: ``fwd`` (activations, stage j to j+1), ``bwd`` (gradients, j+1 to j), ``ctl`` (collectives
along the pipeline: loss broadcast, state gathering) and ``dp`` (gradient all-reduce among the
replicas of a stage). Forward and backward traffic get their own groups so that, on NCCL, a
posted gradient receive never queues behind an activation send on the same communicator.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from pipepar.distributed.failure import Where

__all__ = ["Mesh", "build_mesh", "check_grid"]

logger = logging.getLogger(__name__)


@dataclass
class Mesh:
    """This rank's place in the grid and its process groups (``None`` where not needed)."""

    pp: int
    """Stages per pipeline."""
    dp: int
    """Data-parallel replicas."""
    where: Where
    """Global rank, stage index and replica index of this rank."""
    pipeline_ranks: list[int]
    """Global ranks of this replica's stages, in stage order."""
    replica_ranks: list[int]
    """Global ranks holding this rank's stage, in replica order."""
    grid_ranks: list[int]
    """Global ranks of the whole grid, in group-rank order."""
    backend: str
    """Backend of the groups, ``"gloo"`` or ``"nccl"``."""
    fwd: dist.ProcessGroup | None = None
    bwd: dist.ProcessGroup | None = None
    ctl: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    closed: bool = field(default=False)

    @property
    def stage(self) -> int:
        """Index of this rank's stage."""
        return self.where.stage

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage of this replica, if any."""
        return self.pipeline_ranks[self.stage - 1] if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next stage of this replica, if any."""
        return self.pipeline_ranks[self.stage + 1] if self.stage < self.pp - 1 else None

    @property
    def last_rank(self) -> int:
        """Global rank of this replica's last stage (it computes the loss)."""
        return self.pipeline_ranks[-1]

    def close(self) -> None:
        """Destroy this pipeline's groups so that peers blocked on this rank see it leave."""
        if self.closed:
            return
        self.closed = True
        for name in ("fwd", "bwd", "ctl", "dp_group"):
            group = getattr(self, name)
            setattr(self, name, None)
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # already gone; nothing else to release
                    logger.debug("could not destroy group %s", name, exc_info=True)
        gc.collect()  # the backend closes its connections once the last reference is gone


def check_grid(world_size: int, n_stages: int, dp: object) -> int:
    """Check that ``world_size == n_stages * dp`` before any communication; return ``dp``.

    Example:
        >>> check_grid(4, 2, 2)
        2
    """
    if isinstance(dp, bool) or not isinstance(dp, int):
        raise TypeError(f"dp must be an int (replicas), but got {dp!r}; e.g. dp=2")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, but got {dp}; use dp=1 for one pipeline")
    if n_stages * dp != world_size:
        if world_size % n_stages == 0:
            hint = f"pass dp={world_size // n_stages}"
        else:
            hint = f"split the model into a number of stages that divides {world_size}"
        raise ValueError(
            f"balance has {n_stages} stages and dp={dp}, so the grid needs {n_stages * dp} ranks, "
            f"but the process group has {world_size}; {hint}, or launch "
            f"torchrun --nproc-per-node {n_stages * dp}"
        )
    return dp


def build_mesh(pp: int, dp: int, *, group: dist.ProcessGroup | None, timeout: timedelta) -> Mesh:
    """Place this rank in the pp x dp grid of ``group`` and create its process groups.

    Every rank of ``group`` must call this in the same order with the same ``pp`` and ``dp``.

    Args:
        pp: stages per pipeline.
        dp: replicas.
        group: the parent group (``None`` for the world).
        timeout: how long a blocked receive or collective waits before it fails.
    """
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    g = dist.get_rank(parent)
    stage, replica = g % pp, g // pp
    backend = str(dist.get_backend(parent))
    mesh = Mesh(
        pp=pp,
        dp=dp,
        where=Where(rank=ranks[g], stage=stage, replica=replica),
        pipeline_ranks=ranks[replica * pp : (replica + 1) * pp],
        replica_ranks=ranks[stage::pp],
        grid_ranks=list(ranks),
        backend=backend,
    )
    if pp > 1:
        mesh.fwd = _new_group(mesh.pipeline_ranks, timeout, "pipepar-fwd")
        mesh.bwd = _new_group(mesh.pipeline_ranks, timeout, "pipepar-bwd")
        mesh.ctl = _new_group(mesh.pipeline_ranks, timeout, "pipepar-ctl")
    if dp > 1:
        mesh.dp_group = _new_group(mesh.replica_ranks, timeout, "pipepar-dp")
    return mesh


def _new_group(ranks: list[int], timeout: timedelta, desc: str) -> dist.ProcessGroup:
    group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True, group_desc=desc)
    assert isinstance(group, dist.ProcessGroup)  # this rank is a member by construction
    return group
