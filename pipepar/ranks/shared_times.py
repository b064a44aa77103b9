"""The stages' measured times, the same on every rank of the grid, and the check that every rank
runs the same schedule placed on them.

With ``recompute="bubbles"`` each ``R`` is placed on a simulated clock
(:mod:`pipepar.core.recompute_placement`) whose costs decide where it lands. A rank times only
its own stages (:class:`~pipepar.core.action_times.ActionTimes`), yet the schedule is one
object of the whole pipeline: each worker's ``R`` are placed against its peers' actions, and
every rank must place on the same costs to hold the same schedule. :class:`SharedTimes` times
a rank's stages over its second training mini-batch (the first warms up) and shares them once,
in two small all-reduces: along the pipeline (a sum: each stage is timed by one rank, the
others add zero) and over the replicas (the maximum: the replicas step together, their
gradient all-reduce waiting for the slowest, so the slowest replica's time of a stage is the
one the pipeline runs at). Every rank then holds the same numbers, bit for bit, and places
alike.

:func:`check_same_schedule` compares a fingerprint of the placed schedule over the grid, once
per placement, and raises on every rank if any differs, rather than let ranks run orders the
others did not plan for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

import torch
import torch.distributed as dist

from pipepar.core.action_times import KINDS, ActionTimes, Cost, cost_of
from pipepar.core.schedule import Schedule
from pipepar.core.step import Recorder
from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh

__all__ = ["SharedTimes", "check_same_schedule", "fingerprint"]

_MISSING = -1.0
"""A (stage, kind) its rank never timed (times are never negative)."""


class SharedTimes:
    """A rank's stages timed over one training mini-batch, then shared with the grid.

    The first ``warmup`` training mini-batches are not timed: a pipe's first call of a kind
    runs more than its steady steps do (a probe watches every operation of micro-batch 0,
    the shapes travel ahead of the activations), which on small stages outweighs the stages'
    own work.

    Args:
        n_stages: the stages of the pipeline.
        stages: the stages this rank runs (and times).
        warmup: training mini-batches run before the one timed.

    Example:
        >>> times = SharedTimes(4, [0, 3])  # a V: this rank runs stages 0 and 3
        >>> times.recorder() is None  # the first training mini-batch warms up
        True
        >>> times.due()  # after it: not yet
        False
        >>> record = times.recorder()  # hand it to the stages' steps of the next one
        >>> times.due()  # after that one: share the times on every rank
        True
        >>> cost = times.share(mesh, device)  # doctest: +SKIP
    """

    def __init__(self, n_stages: int, stages: Collection[int], *, warmup: int = 1) -> None:
        self.n_stages, self.warmup = n_stages, warmup
        self._times = ActionTimes(n_stages, stages)
        self._steps = 0  # training mini-batches run
        self.shared = False
        """Whether :meth:`share` ran (the times are shared once)."""
        self.means: dict[tuple[int, str], float] = {}
        """Once shared: mean seconds per (stage, action kind), the same on every rank."""

    def recorder(self) -> Recorder | None:
        """What the steps of this training mini-batch report their computations to: the
        times of the one after the warm-up ones, else None."""
        return self._times.record if self._steps == self.warmup else None

    def due(self) -> bool:
        """Count a training mini-batch run; whether the times are to be shared now (after the
        one timed). Every rank counts the same mini-batches, so every rank shares at once."""
        self._steps += 1
        return self._steps == self.warmup + 1 and not self.shared

    def share(self, mesh: Mesh, device: torch.device) -> Cost | None:
        """Every rank's times, the same on every rank of the grid: the costs to place on, or
        None where some stage has no forward or backward time (then unit costs stay).

        A collective: every rank of the grid calls it once, after the same mini-batch.
        """
        self.shared = True
        table = torch.full((self.n_stages, len(KINDS)), 0.0, dtype=torch.float64)
        for s in self._times.stages:
            table[s] = _MISSING
        for (s, kind), seconds in self._times.means().items():
            table[s, KINDS.index(kind)] = seconds
        table = table.to(device)
        _all_reduce(table, mesh.ctl, dist.ReduceOp.SUM, mesh, mesh.pipeline_ranks)
        _all_reduce(table, mesh.dp_group, dist.ReduceOp.MAX, mesh, mesh.replica_ranks)
        self.means = means = {
            (s, kind): seconds
            for s, row in enumerate(table.cpu().tolist())
            for kind, seconds in zip(KINDS, row)
            if seconds != _MISSING
        }
        if any((s, k) not in means for s in range(self.n_stages) for k in ("F", "B")):
            return None
        return cost_of(means)


def fingerprint(schedule: Schedule) -> int:
    """A number that tells schedules apart (every action list and the placement), the same
    in every process (Python's ``hash`` of a string is not).

    Example:
        >>> from pipepar.core.named_schedules import gpipe, one_f_one_b
        >>> fingerprint(one_f_one_b(2, 4)) == fingerprint(one_f_one_b(2, 4))
        True
        >>> fingerprint(one_f_one_b(2, 4)) == fingerprint(gpipe(2, 4))
        False
    """
    text = f"{schedule.actions!r} {schedule.placement!r}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def check_same_schedule(schedule: Schedule, mesh: Mesh, device: torch.device) -> None:
    """Raise on every rank of the grid unless all of them hold ``schedule`` alike.

    A collective: every rank of the grid calls it at the same point.

    Raises:
        RuntimeError: if the ranks' schedules differ.
    """
    mine = fingerprint(schedule)
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    _all_reduce(extremes, mesh.ctl, dist.ReduceOp.MAX, mesh, mesh.pipeline_ranks)
    _all_reduce(extremes, mesh.dp_group, dist.ReduceOp.MAX, mesh, mesh.replica_ranks)
    highest, lowest = int(extremes[0]), -int(extremes[1])
    if highest != lowest:
        raise RuntimeError(
            f"the ranks placed their recomputes into different schedules (fingerprints "
            f"{lowest} to {highest}, rank {mesh.where.rank}'s {mine}: {schedule.name!r} "
            "placed on the stages' shared times); every rank must run the same one. This is "
            "a bug of pipepar's: pass recompute='in_place' (or a schedule that lists its R) "
            "meanwhile, and report it"
        )


def _all_reduce(
    t: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType,
    mesh: Mesh,
    ranks: list[int],
) -> None:
    """``t`` reduced by ``op`` in place over ``group`` (nothing without one: a single rank)."""
    if group is None:
        return
    what = f"sharing the stages' times and schedule over ranks {ranks}"
    with comm(what):
        work = dist.all_reduce(t, op=op, group=group, async_op=True)
    mesh.progress.wait(work, what)
