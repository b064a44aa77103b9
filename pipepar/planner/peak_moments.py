"""When a device's memory can peak, read off the schedule: what each of its stages holds then.

A worker (device) runs its actions one after another (:class:`pipepar.core.schedule.Schedule`).
Walking its list, each action is a moment at which memory may peak, and what is alive then is a
count of per-stage quantities:

- micro-batches held *whole* (forward ran with its graph, or a checkpointed one recomputed for
  its backward), held as *inputs only* (checkpointed, see
  :func:`pipepar.core.recompute.should_checkpoint`), or *waiting for W* (a split backward ran B;
  the graph and the gradients recorded for W stay until W);
- whether the stage's gradient sums exist yet (from its first parameter-gradient action to the
  optimizer step);
- the transient of the action itself: a forward's work space (also when a backward recomputes a
  checkpointed micro-batch), a backward's (with the gradients it makes), the end of a backward,
  B of a split backward, W, the optimizer step.

The walk knows nothing of sizes: :mod:`pipepar.planner.stage_memory` weighs the counts with a
stage's figures. Moments that another moment of the same kind dominates (holds at least as much
of everything) are dropped, so a stage keeps a handful whatever M is and a planner query stays
O(1).

With virtual stages a worker holds several stages and one walk covers them all: each (stage,
micro-batch) pair held is weighed by its own stage's figures at the moment it is held. Summing
each stage's own peak would count peaks that never coincide (ZB-V's stage ``w`` peaks in the
warm-up, stage ``2K-1-w`` in the steady state); ``worker_in_flight`` counts the pairs held at once
correctly but weighs a pair of a light stage like one of a heavy stage. The walk is exact for
both, given the per-stage figures.

With activation offload (:mod:`pipepar.core.offload_plan`), a micro-batch the plan sends out is
held *away* (its input and output only) from the end of its forward until the action that
brings it back starts, and whole again from then on; what came back lives as long as the
original would have (:class:`pipepar.core.offload.ActivationStore`), so after a split B it
waits for W as one that never left.

    >>> s = make("gpipe", 2, 4, n_workers=2)
    >>> [m.kind for m in moments(s, 1, "never", splits=(True,))][:3]
    ['forward', 'forward', 'backward']
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.offload_plan import OffloadPlan, plan_offload
from pipepar.core.recompute import should_checkpoint
from pipepar.core.recompute_placement import without_rebuilds
from pipepar.core.schedule import Action, Schedule

__all__ = ["KINDS", "Moment", "moments", "schedule_for"]

KINDS = ("forward", "backward", "backward_end", "input_grad", "weight", "optimizer")
"""Transients, each a stage figure: the work space of a forward; of a whole backward with the
gradients it makes; the end of a whole backward (its input gradient, the incoming gradient and
the new gradients alive, the micro-batch's activations gone); B of a split backward (the
gradients recorded for W and the input gradient); W (the gradients it makes); the step."""


@dataclass(frozen=True)
class Moment:
    """What a worker holds at one moment, per stage of the worker (in ``stages_of`` order).

    Attributes:
        kind: the transient at this moment, one of :data:`KINDS`.
        acting: position (in the worker's stages) of the stage whose action this is.
        whole: micro-batches held with all their activations.
        inputs: micro-batches held as their input only (checkpointed).
        waiting: micro-batches held whole plus the gradients recorded for their W.
        sums: whether the stage's parameter-gradient sums exist.
        away: micro-batches whose saved activations are in host memory (offload): their
            input and output stay.
        unanswered: micro-batches whose forward ran and whose backward has not begun (the
            one whose backward this is left out): across ranks, a receive of each one's
            output gradient may be posted (:mod:`pipepar.planner.posted_receives`).
        inputs_ahead: 1 where the stage has run a forward and has one still to run (a
            receive of its input may be posted ahead), else 0.
        grads_ahead: 1 where the stage's backward has begun and has a micro-batch still to
            run after this moment (a receive of its gradient may be posted ahead), else 0.
    """

    kind: str
    acting: int
    whole: tuple[int, ...]
    inputs: tuple[int, ...]
    waiting: tuple[int, ...]
    sums: tuple[bool, ...]
    away: tuple[int, ...]
    unanswered: tuple[int, ...] = ()
    inputs_ahead: tuple[int, ...] = ()
    grads_ahead: tuple[int, ...] = ()

    def counts(self) -> tuple[int, ...]:
        """All counts in one tuple (for dominance)."""
        sums = (int(s) for s in self.sums)
        held = (*self.whole, *self.inputs, *self.waiting, *sums, *self.away)
        return (*held, *self.unanswered, *self.inputs_ahead, *self.grads_ahead)


_Key = tuple[int, int]  # (stage, micro-batch)
_HELD = ("whole", "inputs", "waiting", "away")
_UNANSWERED = ("whole", "inputs", "away")  # held before their backward begins


class _Walk:
    """The state of one worker's stages while its action list is walked."""

    def __init__(
        self,
        schedule: Schedule,
        w: int,
        checkpoint: str,
        splits: tuple[bool, ...],
        offload: OffloadPlan | None = None,
    ):
        self.schedule, self.checkpoint, self.splits = schedule, checkpoint, splits
        self.offload = offload
        self.stages = schedule.stages_of(w)
        self.held: dict[_Key, str] = {}  # what each micro-batch in flight is held as
        self.sums = [False] * len(self.stages)
        self.forwards = [0] * len(self.stages)  # run so far (the acting one included)
        self.backwards = [0] * len(self.stages)
        self.found: list[Moment] = []

    def moment(self, kind: str, at: int, key: _Key | None = None, as_: str | None = None) -> None:
        """Record a moment; ``key`` held as ``as_`` (None: already gone) during it."""
        held = dict(self.held)
        if key is not None:
            held.pop(key, None)
            if as_ is not None:
                held[key] = as_
        count = [[0] * len(self.stages) for _ in _HELD]
        unanswered = [0] * len(self.stages)
        for (s, i), what in held.items():
            count[_HELD.index(what)][self.stages.index(s)] += 1
            if what in _UNANSWERED and (s, i) != key:
                unanswered[self.stages.index(s)] += 1
        whole, inputs, waiting, away = (tuple(c) for c in count)
        sums = tuple(self.sums)
        m = self.schedule.n_microbatches
        inputs_ahead = tuple(int(0 < f < m) for f in self.forwards)
        grads_ahead = tuple(int(0 < b < m) for b in self.backwards)
        self.found.append(Moment(kind, at, whole, inputs, waiting, sums, away,
                                 tuple(unanswered), inputs_ahead, grads_ahead))  # fmt: skip

    def run(self, a: Action) -> None:
        key, at = (a.stage, a.microbatch), self.stages.index(a.stage)
        m = self.schedule.n_microbatches
        # The first stage's input needs no gradient: its B is empty and its W the whole backward.
        first = a.stage == 0
        split = self.schedule.splits_backward(*key) and (self.splits[at] or first)
        if self.offload is not None:  # what this action brings back is whole again
            for back in self.offload.reloads.get((a.stage, a.kind, a.microbatch), ()):
                if self.held.get(back) == "away":
                    self.held[back] = "whole"
        if a.kind == "F":
            self.forwards[at] += 1
            ckpt = should_checkpoint(self.checkpoint, key[1], m)
            self.held[key] = "inputs" if ckpt else "whole"
            self.moment("forward", at)
            if not ckpt and self.offload is not None and key in self.offload.sent:
                self.held[key] = "away"  # until the action that brings it back
            return
        # What B holds of the micro-batch: its graph, and on the first stage, whose B only
        # keeps it for W, the incoming gradient too.
        during = "waiting" if split and first else "whole"
        self.backwards[at] += a.kind == "B"
        if a.kind == "B" and self.held.get(key) == "inputs":
            # A checkpointed micro-batch is recomputed first: a forward's work space on top.
            self.moment("forward", at, key, during)
        if a.kind == "B" and split:
            # B keeps the graph (recomputed, if checkpointed) and records gradients for W.
            self.moment("input_grad", at, key, during)
            self.held[key] = "waiting"
        elif a.kind == "B":
            self.moment("backward", at, key, during)
            self.moment("backward_end", at, key, None)
            self._done(key, at)
        elif a.kind == "W" and key in self.held:
            # W restarts autograd keeping the graph: nothing of the micro-batch is freed
            # before it ends, while it makes the gradients (the first stage's whole backward).
            self.moment("weight", at)
            self._done(key, at)

    def _done(self, key: _Key, at: int) -> None:
        self.held.pop(key, None)
        self.sums[at] = True


def moments(
    schedule: Schedule,
    w: int,
    checkpoint: str,
    *,
    splits: tuple[bool, ...],
    offload: OffloadPlan | None = None,
) -> list[Moment]:
    """The moments at which worker ``w``'s memory can peak, dominated ones dropped.

    Args:
        schedule: the schedule.
        w: the worker.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        splits: per stage of the worker, whether its layers allow a split backward (when the
            schedule splits it); a stage that cannot runs its whole backward in B, as the
            runtime does.
        offload: what activation offload sends out and brings back (None: nothing).
    """
    walk = _Walk(schedule, w, checkpoint, splits, offload)
    for action in schedule.worker(w):
        walk.run(action)
    n = len(walk.stages)
    none = (0,) * n
    walk.found.append(Moment("optimizer", -1, none, none, none, (True,) * n, none))
    return _undominated(walk.found)


@functools.lru_cache(maxsize=512)
def worker_moments(
    schedule: Schedule, w: int, checkpoint: str, splits: tuple[bool, ...], offload: bool
) -> tuple[Moment, ...]:
    """:func:`moments` of worker ``w``, with ``offload`` the plan of
    :func:`~pipepar.core.offload_plan.plan_offload` or none, walked once per schedule: the
    memory models of one schedule (a search builds one per profile, sharding and capacity)
    share the walk, which depends on nothing else."""
    sent = offload_of(schedule) if offload else None
    return tuple(moments(schedule, w, checkpoint, splits=splits, offload=sent))


@functools.lru_cache(maxsize=64)
def offload_of(schedule: Schedule) -> OffloadPlan:
    """:func:`~pipepar.core.offload_plan.plan_offload` of ``schedule`` (its default lead and
    distance), made once per schedule."""
    return plan_offload(schedule)


def _undominated(found: list[Moment]) -> list[Moment]:
    kept: list[Moment] = []
    for m in found:
        c = m.counts()
        same = [k for k in kept if (k.kind, k.acting) == (m.kind, m.acting)]
        if any(all(x >= y for x, y in zip(k.counts(), c)) for k in same):
            continue
        kept = [
            k
            for k in kept
            if (k.kind, k.acting) != (m.kind, m.acting)
            or not all(y >= x for x, y in zip(k.counts(), c))
        ]
        kept.append(m)
    return kept


def schedule_for(name: str | Schedule, devices: int, chunks: int) -> Schedule:
    """The schedule ``name`` over ``devices`` workers: one stage each, or two for the
    virtual-stage names (the balance lists two stages per device).

    Example:
        >>> schedule_for("zb-v", 2, 4).n_stages
        4
    """
    if isinstance(name, Schedule):
        name = without_rebuilds(name, "the planner's memory model")
        return make(name, name.n_stages, chunks, n_workers=devices)
    return make(name, devices * _stages_per_worker(name), chunks, n_workers=devices)


def _stages_per_worker(name: str) -> int:
    return 2 if name in VIRTUAL else 1
