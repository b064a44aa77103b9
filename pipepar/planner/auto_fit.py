"""The schedule built for a memory budget (``"auto"``) as one more schedule of the layout
search: for a split and a count of micro-batches, the fastest order whose every device's
predicted peak stays within its capacity.

The named schedules each fix how much a device holds; where none of the V schedules fits a
(pipeline, micro-batches, recompute), an order in between may: the budget search
(:func:`~pipepar.core.schedule_budget.budget_schedule`) builds the fastest one whose
micro-batches in flight stay within what each device has left after its parameters,
gradients and optimizer state, each stage's micro-batch weighed by its activation bytes
(:func:`~pipepar.planner.stage_activations.stage_weights`). Those weights miss what comes on
top at a device's peak (gradients a backward makes, a forward's work space), so the built
order is checked against the planner's walk of each device's actions
(:class:`~pipepar.planner.stage_memory.MemoryModel`); while some device exceeds its capacity,
its budget is lowered by the excess and the order built again, :data:`ROUNDS` at most; then
the order that holds one micro-batch on a device's two stages at most is taken, if it fits
(it is checked first: where it does not fit, no build is tried).

The split is the one that comes closest to fitting under V-Min (the V that holds the least):
the same placement of two stages per device, its memory balanced.

    >>> found = fit_auto(prof, targets, chunks=8, checkpoint="never")
    >>> if found is not None:
    ...     plan, order = found  # order.name == "auto"; the pipe runs order's action lists
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from pipepar.core.named_schedules import v_min
from pipepar.core.schedule import Action, Schedule
from pipepar.core.schedule_budget import budget_schedule
from pipepar.core.schedule_greedy import greedy_orders
from pipepar.planner.plan import Plan, at_balance
from pipepar.planner.plan_search import unconstrained
from pipepar.planner.plan_targets import Target
from pipepar.planner.profile import Profile
from pipepar.planner.stage_activations import stage_ranges, stage_weights
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["ROUNDS", "fit_auto", "v_split"]

ROUNDS = 1
"""How many times an order is built (the first for the room each device has, each next for a
budget lowered by the excess) before the frugal order is taken: each build is the budget
search, a fifth of a second or more, the costliest step of the layout search."""


def fit_auto(
    prof: Profile,
    targets: list[Target],
    *,
    chunks: int,
    checkpoint: str,
    split: list[int] | None = None,
    ranks: str | None = None,
) -> tuple[Plan, Schedule] | None:
    """The plan of the fastest budget-built order of ``split`` (two stages per device) whose
    every device's predicted peak is within its target's capacity, and that order; None if
    none is found.

    Args:
        prof: the profile of one replica's rows, as a device holds it.
        targets: one per device, with its capacity and whether its optimizer steps foreach.
        chunks: micro-batches (M).
        checkpoint: the recompute policy.
        split: layers per stage (``2 * len(targets)`` stages); None: :func:`v_split`'s.
        ranks: the runtime across ranks whose posted receives a device holds too
            (:class:`~pipepar.planner.stage_memory.MemoryModel`); None: one process.
    """
    k = len(targets)
    caps = [t.capacity for t in targets]
    if 2 * k > len(prof) or None in caps:
        return None
    room = [int(c or 0) for c in caps]
    split = split or v_split(prof, targets, chunks, checkpoint, ranks)
    weights = stage_weights(prof, split, chunks, checkpoint)
    ranges = stage_ranges(split)
    foreach = [t.foreach for t in targets]
    memory = MemoryModel(prof, v_min(2 * k, chunks), checkpoint=checkpoint, foreach=foreach)
    frugal = _fitted(prof, _frugal(k, chunks), checkpoint, targets, split, ranks)
    if frugal is None:
        return None
    level = [float(room[w] - _static(memory, ranges, (w, 2 * k - 1 - w))) for w in range(k)]
    for _ in range(ROUNDS):
        try:
            order = budget_schedule(2 * k, chunks, n_workers=k, budget=level, weight=weights,
                                    label="capacity")  # fmt: skip
        except ValueError:  # less room than one micro-batch on all of a device's stages
            break
        memory = MemoryModel(prof, order, checkpoint=checkpoint, foreach=foreach, ranks=ranks)
        plan = at_balance(prof, memory, targets, split)
        peaks = _peaks(plan)
        if all(peaks[w] <= room[w] for w in range(k)):
            return plan, order
        for w in range(k):
            static = _static(memory, ranges, order.stages_of(w))
            if peaks[w] > room[w] and peaks[w] > static:
                lowered = level[w] * (room[w] - static) / (peaks[w] - static)
                level[w] = min(0.97 * level[w], lowered)
    return frugal


def v_split(
    prof: Profile, targets: list[Target], chunks: int, checkpoint: str, ranks: str | None = None
) -> list[int]:
    """Layers per stage of the split that comes closest to fitting V-Min over ``targets``
    (each stage given half its device's capacity), fitting or not; ``ranks``: as
    :func:`fit_auto` takes it."""
    k = len(targets)
    order = v_min(2 * k, chunks)
    memory = MemoryModel(prof, order, checkpoint=checkpoint,
                         foreach=[t.foreach for t in targets], ranks=ranks)  # fmt: skip
    halves = [targets[order.placement[s]] for s in range(2 * k)]
    shares = [t if t.capacity is None else replace(t, capacity=t.capacity // 2) for t in halves]
    return [len(c.layers) for c in unconstrained(memory, shares)]


def _frugal(k: int, m: int) -> Schedule:
    """The V of ``k`` devices in which each holds one micro-batch on its two stages at most:
    about the least any order holds (a few milliseconds, where the budget search takes up to
    seconds), so a split it does not fit is not searched."""
    placement = tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))
    orders = greedy_orders(placement, k, m, (2,) * k, split=False, reserve=True)
    actions = tuple(tuple(Action(s, kind, i) for s, kind, i in work) for work in orders)  # type: ignore[arg-type]
    return Schedule("auto", 2 * k, m, actions, placement)


def _fitted(
    prof: Profile,
    order: Schedule,
    checkpoint: str,
    targets: list[Target],
    split: list[int],
    ranks: str | None,
) -> tuple[Plan, Schedule] | None:
    """The plan of ``order`` split as ``split`` and the order, if every device's predicted
    peak is within its capacity; else None."""
    foreach = [t.foreach for t in targets]
    memory = MemoryModel(prof, order, checkpoint=checkpoint, foreach=foreach, ranks=ranks)
    plan = at_balance(prof, memory, targets, split)
    peaks = _peaks(plan)
    fits = all(peaks[w] <= (t.capacity or 0) for w, t in enumerate(targets))
    return (plan, order) if fits else None


def _peaks(plan: Plan) -> dict[int, int]:
    """Each device's predicted peak."""
    return {s.worker: s.device_peak_bytes for s in plan.stages}


def _static(memory: MemoryModel, ranges: list[tuple[int, int]], stages: Iterable[int]) -> int:
    """Parameters, gradients and optimizer state of ``stages`` (indices into ``ranges``)."""
    return sum(memory.static_bytes(*ranges[s]) for s in stages)
