"""The pp x dp grid of ranks: where this rank sits and the process groups it talks on.

Ranks of the parent group (the world by default) are laid out replica by replica: group rank
``g`` takes pipeline position ``g % pp`` of replica ``g // pp``. A pipeline replica is thus a
run of ``pp`` consecutive ranks (neighbouring positions share a host under torchrun when ``pp``
divides the processes per node), and the ``dp`` copies of one position are ``pp`` ranks apart.
Position ``w`` is worker ``w`` of the schedule: it runs stage ``w``, or several stages under
the virtual-stage schedules (``schedule.stages_of(w)``), so ``pp`` is the number of workers,
not always the number of stages.

Each rank joins four small groups, all created with local synchronization so only members take
part: ``fwd`` (activations into a stage from the rank of the stage before), ``bwd`` (gradients
back), ``ctl`` (collectives along the pipeline: loss sharing, state gathering) and ``dp``
(gradient all-reduce among the replicas of a position). Forward and backward traffic get their
own groups so that, on NCCL, a posted gradient receive never queues behind an activation send
on the same communicator. The groups time out after the pipe's ``timeout``, and every wait on
them goes through the mesh's :class:`~pipepar.ranks.progress.Progress`, which gives up
after as long and says what it waited for.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from pipepar.ranks.failure import Where
from pipepar.ranks.progress import Progress
from pipepar.ranks.shared_memory import SharedMemory, connect

__all__ = ["Mesh", "build_mesh", "check_grid"]

logger = logging.getLogger(__name__)


@dataclass
class Mesh:
    """This rank's place in the grid and its process groups (``None`` where not needed)."""

    pp: int
    """Ranks per pipeline (the schedule's workers)."""
    dp: int
    """Data-parallel replicas."""
    where: Where
    """Global rank, pipeline position (and stages) and replica index of this rank."""
    pipeline_ranks: list[int]
    """Global ranks of this replica, in pipeline-position order (``pipeline_ranks[w]`` runs
    worker ``w``'s stages)."""
    replica_ranks: list[int]
    """Global ranks at this rank's position (holding its stages), in replica order."""
    grid_ranks: list[int]
    """Global ranks of the whole grid, in group-rank order."""
    backend: str
    """Backend of the groups, ``"gloo"`` or ``"nccl"``."""
    fwd: dist.ProcessGroup | None = None
    bwd: dist.ProcessGroup | None = None
    ctl: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    closed: bool = field(default=False)
    progress: Progress = field(default_factory=Progress)
    """What this rank runs and waits for; every wait on the groups goes through it."""
    shared: SharedMemory | None = None
    """Messages with same-host neighbours through shared memory, if any (gloo only)."""

    @property
    def stage(self) -> int:
        """This rank's position in the pipeline (worker index of the schedule)."""
        return self.where.stage

    @property
    def prev_rank(self) -> int | None:
        """Global rank at the previous position of this replica, if any."""
        return self.pipeline_ranks[self.stage - 1] if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        """Global rank at the next position of this replica, if any."""
        return self.pipeline_ranks[self.stage + 1] if self.stage < self.pp - 1 else None

    def isend(self, t: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Any:
        """Send ``t`` to global rank ``peer`` on ``group`` (:attr:`fwd` or :attr:`bwd`) with
        ``tag``: through shared memory where :attr:`shared` covers it, else the group's own
        ``isend``. Returns the work to wait for."""
        route = self._shared(t, peer, group)
        if route is not None:
            return route[0].isend(t, peer, route[1], tag)
        return dist.isend(t, peer, group=group, tag=tag)

    def irecv(self, t: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Any:
        """Receive into ``t`` from global rank ``peer`` (see :meth:`isend`)."""
        route = self._shared(t, peer, group)
        if route is not None:
            return route[0].irecv(t, peer, route[1], tag)
        return dist.irecv(t, peer, group=group, tag=tag)

    def _shared(
        self, t: Tensor, peer: int, group: dist.ProcessGroup | None
    ) -> tuple[SharedMemory, str] | None:
        """:attr:`shared` and the group's name (``"fwd"``, ``"bwd"``) if the message goes
        through shared memory; ``None`` if it goes through the group itself."""
        name = "fwd" if group is self.fwd else "bwd" if group is self.bwd else ""
        if self.shared is not None and self.shared.covers(peer, t, name):
            return self.shared, name
        return None

    def close(self) -> None:
        """Destroy this pipeline's groups so that peers blocked on this rank see it leave."""
        if self.closed:
            return
        self.closed = True
        if self.shared is not None:
            self.shared.close()
        left = []
        for name in ("fwd", "bwd", "ctl", "dp_group"):
            group = getattr(self, name)
            setattr(self, name, None)
            if group is not None:
                left.append(weakref.ref(group))
                try:
                    dist.destroy_process_group(group)
                except Exception:  # already gone; nothing else to release
                    logger.debug("could not destroy group %s", name, exc_info=True)
            del group
        # The backend closes its connections once the last reference is gone. A group still
        # alive here is held in a reference cycle (a failed step's traceback, say): collect it.
        # A full collection costs a big program (transformers imported) about 0.4 s, so only then.
        if any(ref() is not None for ref in left):
            gc.collect()


def check_grid(world_size: int, pp: int, dp: object, *, n_stages: int | None = None) -> int:
    """Check that ``world_size == pp * dp`` before any communication; return ``dp``.

    Args:
        world_size: ranks of the parent group.
        pp: ranks per pipeline (the schedule's workers).
        dp: replicas asked for.
        n_stages: stages of the balance when it differs from ``pp`` (virtual stages), to
            name both in the error.

    Example:
        >>> check_grid(4, 2, 2)
        2
        >>> check_grid(2, 1, 2, n_stages=2)  # 2 virtual stages on 1 rank, 2 replicas
        2
    """
    if isinstance(dp, bool) or not isinstance(dp, int):
        raise TypeError(f"dp must be an int (replicas), but got {dp!r}; e.g. dp=2")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, but got {dp}; use dp=1 for one pipeline")
    if pp * dp != world_size:
        shape, split = f"balance has {pp} stages", "a number of stages"
        if n_stages is not None and n_stages != pp:  # several stages per rank
            shape = f"balance has {n_stages} stages on {pp} ranks per pipeline"
            split = f"{n_stages // pp} stages per rank over a number of ranks"
        if world_size % pp == 0:
            hint = f"pass dp={world_size // pp}"
        else:
            hint = f"split the model into {split} that divides {world_size}"
        raise ValueError(
            f"{shape} and dp={dp}, so the grid needs {pp * dp} ranks, but the process group "
            f"has {world_size}; {hint}, or launch torchrun --nproc-per-node {pp * dp}"
        )
    return dp


def build_mesh(
    pp: int,
    dp: int,
    *,
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
    placement: Sequence[int] = (),
) -> Mesh:
    """Place this rank in the pp x dp grid of ``group`` and create its process groups.

    Every rank of ``group`` must call this in the same order with the same ``pp`` and ``dp``.

    Args:
        pp: ranks per pipeline (the schedule's workers).
        dp: replicas.
        group: the parent group (``None`` for the world).
        timeout: how long a blocked receive or collective waits before it fails (``None``:
            the backend's default group timeout, and no limit of pipepar's).
        placement: the schedule's ``placement`` (position of each stage), so that error
            reports name every stage of a rank that runs several.
    """
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    g = dist.get_rank(parent)
    position, replica = g % pp, g // pp
    stages = tuple(s for s, w in enumerate(placement) if w == position)
    backend = str(dist.get_backend(parent))
    mesh = Mesh(
        pp=pp,
        dp=dp,
        where=Where(rank=ranks[g], stage=position, replica=replica, stages=stages),
        pipeline_ranks=ranks[replica * pp : (replica + 1) * pp],
        replica_ranks=ranks[position::pp],
        grid_ranks=list(ranks),
        backend=backend,
        progress=Progress(
            None if timeout is None else timeout.total_seconds(), bounded=backend == "gloo"
        ),
    )
    if pp > 1:
        mesh.fwd = _new_group(mesh.pipeline_ranks, timeout, "pipepar-fwd")
        mesh.bwd = _new_group(mesh.pipeline_ranks, timeout, "pipepar-bwd")
        mesh.ctl = _new_group(mesh.pipeline_ranks, timeout, "pipepar-ctl")
        if backend == "gloo":
            mesh.shared = connect(mesh.ctl, ranks[g], mesh.pipeline_ranks)
    if dp > 1:
        mesh.dp_group = _new_group(mesh.replica_ranks, timeout, "pipepar-dp")
    return mesh


def _new_group(ranks: list[int], timeout: timedelta | None, desc: str) -> dist.ProcessGroup:
    group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True, group_desc=desc)
    assert isinstance(group, dist.ProcessGroup)  # this rank is a member by construction
    return group
