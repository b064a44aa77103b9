"""The schedule each mini-batch runs across ranks, its recomputes placed on the stages' times once
every rank holds them: what both computes across ranks share.

With ``recompute="bubbles"`` a pipe across ranks runs its recomputes placed on unit costs until
a training mini-batch (the second) has timed its stages; the ranks then share those times
(:class:`~pipepar.ranks.shared_times.SharedTimes`) and place again on them, every rank alike,
from the next mini-batch on. :class:`MeasuredPlacement` keeps that sequence for a compute: the
recorder its steps report to, the sharing after the timed mini-batch, a schedule per count of
micro-batches (a short batch runs fewer), placed once per count and checked the same on every
rank (:func:`~pipepar.ranks.shared_times.check_same_schedule`) the first time it is placed on
the shared times. The chain of an ``nn.Sequential`` (:mod:`pipepar.ranks.runtime`) and any
model cut while it runs (:mod:`pipepar.program.rank_compute`) both hold one; what each times
is their business (the cut model's forward waits for messages inside its actions, and leaves
those waits out).
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from pipepar.core.action_times import Cost
from pipepar.core.named_schedules import NAMES, make
from pipepar.core.recompute_placement import placed_for, places_recomputes
from pipepar.core.schedule import Schedule
from pipepar.core.step import Recorder
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.shared_times import SharedTimes, check_same_schedule

__all__ = ["MeasuredPlacement", "fewer_microbatches"]


class MeasuredPlacement:
    """The schedule of each count of micro-batches, placed on unit costs, then on the stages'
    times shared by every rank of the grid.

    Args:
        schedule: what the pipe runs for a full mini-batch now (placed on unit costs).
        asked: the schedule as asked, before its recomputes were placed (None: ``schedule``,
            run as it is, rebuilt for a batch of fewer micro-batches; nothing is timed).
        recompute: ``"in_place"`` or ``"bubbles"``.
        checkpoint: which micro-batches recompute.
        stages: this rank's stages (the ones it times).
        mesh: this rank's grid position.
        device: where the sharing's collectives run.
    """

    def __init__(
        self,
        schedule: Schedule,
        asked: Schedule | None,
        recompute: str,
        checkpoint: str,
        stages: Collection[int],
        mesh: Mesh,
        device: torch.device,
    ) -> None:
        self.recompute, self.checkpoint = recompute, checkpoint
        self.mesh, self.device = mesh, device
        self.chunks = schedule.n_microbatches
        self._asked = asked or schedule
        self._timed = (
            SharedTimes(schedule.n_stages, stages)
            if asked is not None and places_recomputes(asked, recompute)
            else None
        )
        self._cost: Cost | None = None  # unit costs until the stages' times are shared
        self._by_count = {schedule.n_microbatches: schedule}
        self._checked: set[int] = set()  # counts whose schedule placed on times all ranks hold

    def recorder(self, grad: bool) -> Recorder | None:
        """What this mini-batch's steps report their computations to (a training mini-batch
        that times the stages), else None."""
        return self._timed.recorder() if grad and self._timed is not None else None

    def ran(self, grad: bool) -> None:
        """A mini-batch ran (``grad``: a training one): after the timed one, share the times
        with every rank (a collective) and place again on them from the next one on."""
        if grad and self._timed is not None and self._timed.due():
            self._cost = self._timed.share(self.mesh, self.device)
            self._by_count.clear()

    @property
    def full(self) -> Schedule:
        """The schedule of a full mini-batch, as every rank runs it now."""
        return self._placed(self.chunks)

    def placed(self, m: int) -> Schedule:
        """The schedule of a batch of ``m`` micro-batches, checked the same on every rank the
        first time the count is placed on measured times (a collective then: every rank
        reaches it at the same mini-batch)."""
        schedule = self._placed(m)
        if self._cost is not None and m not in self._checked:
            check_same_schedule(schedule, self.mesh, self.device)
            self._checked.add(m)
        return schedule

    def _placed(self, m: int) -> Schedule:
        found = self._by_count.get(m)
        if found is None:
            base = fewer_microbatches(self._asked, m)
            found = placed_for(base, self.recompute, self.checkpoint, cost=self._cost)
            self._by_count[m] = found
        return found


@functools.lru_cache(maxsize=16)
def fewer_microbatches(schedule: Schedule, m: int) -> Schedule:
    """``schedule`` rebuilt for ``m`` micro-batches (a batch with fewer rows than chunks)."""
    if m == schedule.n_microbatches:
        return schedule
    if schedule.name not in NAMES:
        raise ValueError(
            f"the batch gives {m} micro-batches but the schedule object was built for "
            f"{schedule.n_microbatches}; pass at least {schedule.n_microbatches} rows (or "
            f"{schedule.n_microbatches} microbatches=), or a schedule by name (which is "
            "rebuilt for each batch's count)"
        )
    return make(schedule.name, schedule.n_stages, m, n_workers=schedule.n_workers)
