"""Where a checkpointed micro-batch recomputes: an ``R`` action placed in a worker's idle time.

A checkpointed micro-batch keeps only its stage input after ``F`` and runs the stage again
before its backward. Done inside ``B`` (in place), that recompute sits on the critical path:
the gradient has arrived and waits for it. Listed as its own action ``R``
(:mod:`pipepar.core.schedule`), it may run earlier, in time the worker would otherwise idle
waiting for an input (Mario, PPoPP 2025, places recomputes in a schedule's bubbles this way).
Running it earlier costs memory: from ``R`` to its last backward action a micro-batch holds
its whole graph again, so how many rebuilt micro-batches a worker holds at once is bounded.

:func:`place_recomputes` takes a schedule without ``R`` and the (stage, micro-batch) pairs that
recompute, lists each ``R`` just before its ``B`` (where it already runs while ``B`` waits for
its gradient), then on a simulated clock (:func:`pipepar.core.schedule.timed`) moves each ``R``
whose time still delays its ``B`` to the latest earlier idle slot of its worker long enough to
hold it, if the bound allows; otherwise it stays before ``B``. The default bound is what the
in-place listing holds, so the moves add no memory.

This module only reorders a list; what ``R`` computes is :meth:`pipepar.core.step.StageStep
.rebuild`'s business (a stage's layers run again; a model cut while it runs overrides it to
run its checkpointed units again).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pipepar.core.action_times import Cost
from pipepar.core.recompute import should_checkpoint
from pipepar.core.schedule import Action, Schedule, timed, unit_costs

__all__ = [
    "PLACEMENTS",
    "check_placement",
    "check_rebuilds",
    "checkpointed",
    "place_recomputes",
    "placed_for",
    "places_recomputes",
    "without_rebuilds",
]

PLACEMENTS = ("in_place", "bubbles")
"""``recompute=`` of ``wrap``: inside ``B`` (``"in_place"``), or as ``R`` actions placed by
:func:`place_recomputes` (``"bubbles"``)."""

_EPS = 1e-9


def check_placement(recompute: object, checkpoint: str) -> str:
    """``recompute=``: one of :data:`PLACEMENTS`; ``"bubbles"`` needs micro-batches that
    recompute (a ``checkpoint`` other than ``"never"``).

    Example:
        >>> check_placement("bubbles", "always")
        'bubbles'
    """
    if not isinstance(recompute, str) or recompute not in PLACEMENTS:
        raise ValueError(
            f"recompute must be one of {', '.join(repr(p) for p in PLACEMENTS)}, but got "
            f"{recompute!r}; pass recompute='bubbles' to recompute in the schedule's idle time"
        )
    if recompute == "bubbles" and checkpoint == "never":
        raise ValueError(
            "recompute='bubbles' places the recompute of checkpointed micro-batches, but "
            "checkpoint='never' recomputes none; pass checkpoint='always' (or 'except_last')"
        )
    return recompute


def placed_for(
    schedule: Schedule, recompute: str, checkpoint: str, *, cost: Cost | None = None
) -> Schedule:
    """The schedule a batch runs: ``schedule`` itself (in place, or ``R`` listed already,
    checked against ``checkpoint``), or with each recompute placed by
    :func:`place_recomputes` (``"bubbles"``) on ``cost`` (None: unit costs)."""
    if _lists_rebuilds(schedule):
        check_rebuilds(schedule, checkpoint)
        return schedule
    if not places_recomputes(schedule, recompute):
        return schedule
    return place_recomputes(schedule, checkpointed(schedule, checkpoint), cost=cost)


def places_recomputes(schedule: Schedule, recompute: str) -> bool:
    """Whether :func:`placed_for` places ``schedule``'s recomputes (on the costs it is given),
    rather than running it as it is.

    Example:
        >>> from pipepar.core.named_schedules import one_f_one_b
        >>> places_recomputes(one_f_one_b(2, 2), "bubbles")
        True
    """
    return recompute == "bubbles" and not _lists_rebuilds(schedule)


def checkpointed(schedule: Schedule, mode: str) -> set[tuple[int, int]]:
    """The (stage, micro-batch) pairs that recompute under checkpoint ``mode``.

    Example:
        >>> from pipepar.core.named_schedules import one_f_one_b
        >>> sorted(checkpointed(one_f_one_b(2, 2), "except_last"))
        [(0, 0), (1, 0)]
    """
    m = schedule.n_microbatches
    kept = [i for i in range(m) if should_checkpoint(mode, i, m)]
    return {(s, i) for s in range(schedule.n_stages) for i in kept}


def without_rebuilds(schedule: Schedule, what: str) -> Schedule:
    """``schedule``, for ``what`` (the planner's prediction or measurement), which counts the
    recompute inside ``B``: a schedule that lists ``R`` is refused, never costed as if its
    ``R`` were something else."""
    if _lists_rebuilds(schedule):
        raise ValueError(
            f"{what} counts the recompute inside B, but schedule {schedule.name!r} lists R "
            "actions; pass the schedule without them (recompute='bubbles' places them when "
            "the pipe runs)"
        )
    return schedule


def _lists_rebuilds(schedule: Schedule) -> bool:
    return any(a.kind == "R" for work in schedule.actions for a in work)


def check_rebuilds(schedule: Schedule, mode: str) -> None:
    """Refuse a schedule that lists ``R`` for a micro-batch its forward keeps whole under
    checkpoint ``mode`` (nothing to rebuild: the ``R`` would silently do nothing)."""
    kept = [
        repr(a)
        for work in schedule.actions
        for a in work
        if a.kind == "R" and not should_checkpoint(mode, a.microbatch, schedule.n_microbatches)
    ]
    if kept:
        raise ValueError(
            f"schedule {schedule.name!r} lists {', '.join(kept[:3])} but checkpoint={mode!r} "
            "keeps those micro-batches' activations, so there is nothing to recompute; pass "
            "checkpoint='always' (or drop the R actions)"
        )


def place_recomputes(
    schedule: Schedule,
    rebuilt: Collection[tuple[int, int]],
    *,
    bound: int | Sequence[int] | None = None,
    cost: Cost | None = None,
) -> Schedule:
    """``schedule`` with an ``R`` for each (stage, micro-batch) of ``rebuilt``, each in the
    latest idle slot of its worker before its ``B`` that holds it, else just before ``B``.

    Args:
        schedule: a schedule without ``R`` actions.
        rebuilt: the (stage, micro-batch) pairs that recompute (:func:`checkpointed`).
        bound: per worker (or one for all), the most rebuilt micro-batches it may hold at once
            (:meth:`Schedule.worker_rebuilt`); None: as many as with every ``R`` just before
            its ``B`` (no more memory than recomputing in place).
        cost: how long an action takes, ``cost(action, split)``; None: F = R = W = 1, B = 1,
            or 2 for a whole backward, each divided by the stages per worker.

    Raises:
        ValueError: if the schedule lists ``R`` already, a pair is out of range, or the bound
            is below what recomputing in place holds.

    Example:
        >>> from pipepar.core.named_schedules import gpipe
        >>> s = place_recomputes(gpipe(2, 2), {(0, 0), (0, 1), (1, 0), (1, 1)})
        >>> [str(a) for a in s.worker(0)]  # each R runs while its B waits for the gradient
        ['F0', 'F1', 'R1', 'B1', 'R0', 'B0']
    """
    _check_input(schedule, rebuilt)
    placed = _in_place(schedule, set(rebuilt))
    limits = _bounds(placed, bound)
    price = cost or unit_costs(placed.virtual)
    finish = timed(placed, price)
    for a in sorted((b for b in finish if _is_rebuilt_b(b, rebuilt)), key=finish.__getitem__):
        r = Action(a.stage, "R", a.microbatch)
        moved = _move_earlier(placed, r, limits, price, finish)
        if moved is not None:  # the clock changes only where an R moved
            placed, finish = moved, timed(moved, price)
    return placed


def _check_input(schedule: Schedule, rebuilt: Collection[tuple[int, int]]) -> None:
    if _lists_rebuilds(schedule):
        raise ValueError(
            f"schedule {schedule.name!r} lists R actions already; pass it without them, or "
            "run it as it is"
        )
    bad = [
        p
        for p in rebuilt
        if not (0 <= p[0] < schedule.n_stages and 0 <= p[1] < schedule.n_microbatches)
    ]
    if bad:
        raise ValueError(
            f"rebuilt names {sorted(bad)[:3]} but schedule {schedule.name!r} has stages "
            f"0..{schedule.n_stages - 1} and micro-batches 0..{schedule.n_microbatches - 1}; "
            "pass (stage, micro-batch) pairs within them"
        )


def _is_rebuilt_b(a: Action, rebuilt: Collection[tuple[int, int]]) -> bool:
    return a.kind == "B" and (a.stage, a.microbatch) in rebuilt


def _in_place(schedule: Schedule, rebuilt: set[tuple[int, int]]) -> Schedule:
    """Each rebuilt micro-batch's ``R`` listed just before its ``B``."""
    lists = []
    for work in schedule.actions:
        out: list[Action] = []
        for a in work:
            if _is_rebuilt_b(a, rebuilt):
                out.append(Action(a.stage, "R", a.microbatch))
            out.append(a)
        lists.append(tuple(out))
    return _with(schedule, lists)


def _with(schedule: Schedule, lists: Sequence[tuple[Action, ...]]) -> Schedule:
    """``schedule`` with other lists, under its name (a named one is rebuilt by it for a
    batch of another count, and its recomputes placed again)."""
    return Schedule(
        schedule.name,
        schedule.n_stages,
        schedule.n_microbatches,
        tuple(lists),
        schedule.placement,
        schedule.max_in_flight,
    )


def _bounds(placed: Schedule, bound: int | Sequence[int] | None) -> tuple[int, ...]:
    """The bound per worker, at least what the in-place listing holds."""
    floor = tuple(placed.worker_rebuilt(w) for w in range(placed.n_workers))
    if bound is None:
        return floor
    if isinstance(bound, int) and not isinstance(bound, bool):
        limits = (bound,) * placed.n_workers
    elif isinstance(bound, Sequence) and all(isinstance(b, int) for b in bound):
        limits = tuple(bound)
    else:
        raise TypeError(f"bound must be an int, ints per worker or None, but got {bound!r}")
    if len(limits) != placed.n_workers:
        raise ValueError(
            f"bound gives {len(limits)} values but the schedule has {placed.n_workers} "
            "workers; give one per worker, or one int for all"
        )
    for w, (got, need) in enumerate(zip(limits, floor)):
        if got < need:
            raise ValueError(
                f"bound={got} on worker {w} but recomputing just before each B already holds "
                f"{need} rebuilt micro-batches there (their W run later); pass bound>={need}"
            )
    return limits


def _move_earlier(
    placed: Schedule,
    r: Action,
    limits: tuple[int, ...],
    cost: Cost,
    finish: dict[Action, float],
) -> Schedule | None:
    """``placed`` with ``r`` moved to the latest earlier idle slot that holds it, if ``r``
    delays its ``B`` where it is and the bound allows; else None. ``finish``: ``placed``
    timed."""
    w = placed.placement[r.stage]
    work = list(placed.actions[w])
    at = work.index(r)
    b = work.index(Action(r.stage, "B", r.microbatch))
    f = work.index(Action(r.stage, "F", r.microbatch))
    if _ready(placed, work[b], finish) >= finish[r] - _EPS:
        return None  # it ran while its B waited for the gradient: hidden already
    need = cost(r, False)
    for p in range(at - 1, f, -1):  # before work[p], after work[p - 1] (F at the earliest)
        gap = finish[work[p]] - cost(work[p], _split(placed, work[p])) - finish[work[p - 1]]
        if gap + _EPS < need:
            continue
        lists = list(placed.actions)
        moved = work[:at] + work[at + 1 :]
        moved.insert(p, r)
        lists[w] = tuple(moved)
        candidate = _with(placed, lists)
        if candidate.worker_rebuilt(w) <= limits[w]:
            return candidate
        return None  # earlier slots hold it longer still
    return None


def _ready(schedule: Schedule, b: Action, finish: dict[Action, float]) -> float:
    """When ``b``'s gradient is there (the next stage's B, or this stage's F on the last)."""
    if b.stage == schedule.n_stages - 1:
        return finish[Action(b.stage, "F", b.microbatch)]
    return finish[Action(b.stage + 1, "B", b.microbatch)]


def _split(schedule: Schedule, a: Action) -> bool:
    return schedule.splits_backward(a.stage, a.microbatch)
