"""Which micro-batches send their saved activations to host memory, and when they come back.

The schedule knows, for every stage and micro-batch, how far apart its forward and its backward
are on the worker that runs them. Under 1F1B, stage 0 runs ``K - 1`` other actions and more
between a micro-batch's ``F`` and its ``B``; the last stage runs its ``B`` right after its
``F``. :func:`plan_offload` reads the worker lists: a micro-batch is sent out on a stage if,
between its ``F`` and the action that brings it back, the worker runs at least ``away`` other
actions (time for the copies to go and come back while something else computes); it is brought
back when the worker starts the action ``lead`` places before its ``B`` (so that the copy
overlaps that action) and stays until its last backward action (a split backward's ``W``
reads what its ``B`` did not). :class:`Offloader` carries the plan out on the stages' stores
(:mod:`pipepar.core.offload`).

    >>> from pipepar.core.named_schedules import one_f_one_b
    >>> [str(a) for a in one_f_one_b(4, 8).stage(0)][:7]
    ['F0', 'F1', 'F2', 'F3', 'B0', 'F4', 'B1']
    >>> plan = plan_offload(one_f_one_b(4, 8))
    >>> sorted(i for s, i in plan.sent if s == 0)
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> plan.reloads[(0, "F", 3)]  # micro-batch 0 comes back as stage 0 starts F3
    ((0, 0),)
    >>> sorted(i for s, i in plan.sent if s == 3)  # the last stage runs each B after its F
    []
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from torch import Tensor

from pipepar.core.offload import ActivationStore, OffloadCounts, Pack
from pipepar.core.schedule import Action, Schedule
from pipepar.core.stage import Stage

__all__ = ["OffloadPlan", "Offloader", "offloader_for", "plan_offload"]

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class OffloadPlan:
    """The micro-batches sent out per stage, and what each action brings back as it starts."""

    sent: frozenset[Key]
    """``(stage, micro-batch)`` whose forward sends its saved tensors to host memory."""
    reloads: Mapping[tuple[int, str, int], tuple[Key, ...]]
    """By ``(stage, kind, micro-batch)`` of an action: what to bring back as it starts."""


def plan_offload(schedule: Schedule, *, lead: int = 1, away: int = 1) -> OffloadPlan:
    """Plan the offload of ``schedule``'s activations (see the module's docstring).

    Args:
        schedule: the schedule the pipe runs.
        lead: how many actions before its backward a micro-batch starts coming back.
        away: the fewest actions a micro-batch's tensors must stay away to be sent out.

    Raises:
        ValueError: ``lead`` below 1 or ``away`` below 1.
    """
    if lead < 1 or away < 1:
        raise ValueError(
            f"lead and away must be at least 1, but got lead={lead}, away={away}; "
            "lead=1 brings a micro-batch back during the action before its backward"
        )
    sent: set[Key] = set()
    reloads: dict[tuple[int, str, int], list[Key]] = {}
    for actions in schedule.actions:
        for key, (forward, back) in _spans(actions).items():
            start = back - lead
            if start - forward - 1 < away:
                continue
            trigger = actions[start]
            sent.add(key)
            reloads.setdefault((trigger.stage, trigger.kind, trigger.microbatch), []).append(key)
    return OffloadPlan(frozenset(sent), {k: tuple(v) for k, v in reloads.items()})


def _spans(actions: Sequence[Action]) -> dict[Key, tuple[int, int]]:
    """Per ``(stage, micro-batch)`` of one worker: the positions of its ``F`` and of its first
    backward action (``B``)."""
    forwards: dict[Key, int] = {}
    spans: dict[Key, tuple[int, int]] = {}
    for k, a in enumerate(actions):
        key = (a.stage, a.microbatch)
        if a.kind == "F":
            forwards[key] = k
        elif a.kind == "B" and key in forwards:
            spans[key] = (forwards[key], k)
    return spans


class Offloader:
    """One mini-batch's offload on the stages of a run: a store per stage, the plan's reloads.

    The stage steps call :meth:`before` as each action starts, compute a forward inside
    :meth:`saving`, and :meth:`release` a micro-batch after its last backward action. A worker
    only touches the stores of its own stages (the plan brings back only what its own
    worker's list names), so workers on threads share an Offloader without a lock.

    Args:
        plan: what to send out and when to bring it back.
        stages: the stages this process runs.
        min_bytes: the smallest tensor sent out (:class:`ActivationStore`).
    """

    def __init__(self, plan: OffloadPlan, stages: Iterable[Stage], **store: int) -> None:
        self.plan = plan
        self.stores = {s.index: ActivationStore(s.device, _weights(s), **store) for s in stages}

    def before(self, stage: int, kind: str, i: int) -> None:
        """Action ``kind`` of micro-batch ``i`` on ``stage`` starts: bring back what it leads."""
        for s, j in self.plan.reloads.get((stage, kind, i), ()):
            self.stores[s].reload(j)

    def saving(self, stage: int, i: int, first: Pack | None = None) -> AbstractContextManager[None]:
        """Around the forward of micro-batch ``i`` on ``stage``: sends out what it saves if the
        plan says so (``first``: see :meth:`ActivationStore.saving`)."""
        if (stage, i) not in self.plan.sent:
            return nullcontext()
        return self.stores[stage].saving(i, first)

    def release(self, stage: int, i: int) -> None:
        """Micro-batch ``i``'s backward on ``stage`` is done."""
        self.stores[stage].release(i)

    def clear(self) -> None:
        """Forget everything held (the mini-batch ended or failed)."""
        for store in self.stores.values():
            store.clear()

    def counts(self) -> OffloadCounts:
        """What the stores moved, summed (the peak: the largest of one store's)."""
        total = OffloadCounts()
        for store in self.stores.values():
            c = store.counts
            total.sent += c.sent
            total.tensors += c.tensors
            total.reloaded += c.reloaded
            total.late += c.late
            total.resident += c.resident
            total.peak_resident = max(total.peak_resident, c.peak_resident)
        return total


def offloader_for(offload: bool, schedule: Schedule, stages: Iterable[Stage]) -> Offloader | None:
    """The offload of one mini-batch of ``schedule`` on ``stages`` (this process's), or None
    when nothing is offloaded (``offload`` False, or a forward without a backward)."""
    return Offloader(plan_offload(schedule), stages) if offload else None


def _weights(stage: Stage) -> Iterator[Tensor]:
    for layer in stage.layers:
        yield from layer.parameters()
        yield from layer.buffers()
