"""A schedule built for a memory budget: the fastest action lists whose micro-batches in flight
stay within what each worker may hold.

The named schedules each fix a memory bound (1F1B: the first stage holds ``K`` micro-batches;
V-Half about half of that; V-Min a third) and take the step time that comes with it. Given the
stages' costs and a budget per worker instead, the order is searched: every candidate below is
built, those whose peak exceeds the budget are dropped, and the shortest by the simulated clock
(:func:`pipepar.core.schedule.timed`, with the given costs and transfer times) is kept.

Candidates, for each placement the stage count allows (one stage per worker; with ``V`` stages
per worker, looped as interleaved 1F1B, and for ``V = 2`` the V of ZB-V):

- list scheduling (:mod:`pipepar.core.schedule_greedy`) under every uniform bound from one
  micro-batch up to what the budget could hold, the backward whole or split into B and W, with
  and without reserving a micro-batch's room on all of a worker's stages, timed with the given
  costs and with unit costs;
- the V's building blocks repeated (:mod:`pipepar.core.schedule_blocks`);
- the named schedules of that placement (1F1B, ZB-H1, interleaved 1F1B, ZB-V, V-Half, V-Min).

A larger budget keeps every candidate of a smaller one, so more budget is never slower.

The list-scheduled orders and their simulated times depend on the stages, micro-batches and
costs alone, not on the budget or the weights (those say how far up the bounds go and which
orders fit): they are built once and kept for later calls, as a layout search asks for the
same stages with other weights and budgets.

What a worker holds is weighed per stage (:meth:`~pipepar.core.schedule.Schedule.worker_held`):
by default a micro-batch of a stage weighs ``1/V`` (a virtual stage holds ``1/V`` of its
worker's layers), so the budget is in micro-batches of a whole worker, the unit of 1F1B's ``K``;
with each stage's activation bytes per micro-batch as weights, it is in bytes. A worker holds
at least one micro-batch on all its stages at once (its last stage's forward comes before its
first stage's backward), so a budget below the sum of its stages' weights is refused.

    >>> s = budget_schedule(4, 8, n_workers=4, budget=2)
    >>> max(s.worker_held(w, [1.0] * 4) for w in range(4)) <= 2
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import lru_cache

from pipepar.core.named_schedules import (
    interleaved_1f1b,
    one_f_one_b,
    v_half,
    v_min,
    zb_h1,
    zb_v,
)
from pipepar.core.schedule import Action, Schedule, timed
from pipepar.core.schedule_blocks import STYLES, repeated, v_block
from pipepar.core.schedule_greedy import Cost, greedy_orders, unit_cost

__all__ = ["budget_schedule", "least_budget", "makespan", "one_f_one_b_held"]

Budget = float | Sequence[float]
"""One bound for every worker, or one per worker."""


def one_f_one_b_held(n_workers: int, n_microbatches: int) -> int:
    """What 1F1B's first worker holds: ``min(K, M)`` micro-batches of a whole stage.

    Example:
        >>> one_f_one_b_held(4, 8), one_f_one_b_held(4, 2)
        (4, 2)
    """
    return min(n_workers, n_microbatches)


def budget_schedule(
    n_stages: int,
    n_microbatches: int,
    *,
    n_workers: int,
    budget: Budget,
    weight: Sequence[float] | None = None,
    cost: Cost | None = None,
    transfer: Sequence[float] | None = None,
    label: str = "budget",
) -> Schedule:
    """The fastest schedule found whose every worker holds at most its budget.

    Args:
        n_stages: stages (``V * n_workers``; with ``V = 2`` the V placement is a candidate).
        n_microbatches: micro-batches per mini-batch (M).
        n_workers: workers (devices or ranks) K.
        budget: what each worker may hold at once, in the units of ``weight``: one number for
            all workers or one per worker.
        weight: per stage, what one of its micro-batches weighs from its F to its last
            backward action (e.g. activation bytes); default ``1/V`` each, so ``budget`` counts
            micro-batches of a whole worker (1F1B's first worker holds ``min(K, M)``).
        cost: ``cost(stage, kind, split)``, each action's time (``kind`` ``"B"`` with
            ``split=False`` is a whole backward); default: every stage alike, F, B and W 1, a
            whole backward 2 (:func:`makespan` scales that by ``1/V``: the same ranking).
        transfer: per stage boundary ``s -> s+1``, the time to move a value across it when
            the two stages are on different workers; default none.
        label: the argument's name in errors.

    Returns:
        The schedule, named ``"auto"``, ``max_in_flight`` its own peak per worker.

    Raises:
        ValueError: sizes that do not fit (``n_stages`` not a multiple of ``n_workers``), or a
            budget below what any schedule holds (naming the smallest that is feasible).

    Example:
        >>> fast = budget_schedule(8, 8, n_workers=4, budget=4)  # 1F1B's memory: ZB-V's speed
        >>> makespan(fast) <= makespan(zb_v(8, 8))
        True
    """
    v = _virtual(n_stages, n_workers)
    weights = _weights(weight, n_stages, v)
    cost = cost or unit_cost  # the default, 1/V of it: the same order, the same ranking
    bounds = _bounds(budget, n_workers, label)
    _check_feasible(bounds, weights, n_workers, v, label)
    return _fastest(
        n_stages, n_microbatches, n_workers, bounds, tuple(weights), cost, _delays(transfer)
    )


def makespan(
    schedule: Schedule,
    cost: Cost | None = None,
    transfer: Sequence[float] | None = None,
) -> float:
    """The simulated step time of ``schedule`` with ``cost(stage, kind, split)`` per action and
    ``transfer[s]`` across boundary ``s -> s+1`` between workers (defaults as in
    :func:`budget_schedule`).

    Example:
        >>> makespan(one_f_one_b(2, 4))  # (M + K - 1) * (F + 2F)
        15.0
    """
    return _span(schedule, cost or _default_cost(schedule.virtual), _delays(transfer))


# -- search ------------------------------------------------------------------------------------
Delay = tuple[float, ...]


@lru_cache(maxsize=64)  # every pipe of the same description (and a rank's peers) asks alike
def _fastest(
    n: int,
    m: int,
    k: int,
    bounds: tuple[float, ...],
    weights: tuple[float, ...],
    cost: Cost,
    delays: Delay,
) -> Schedule:
    best: tuple[float, float, Schedule] | None = None
    seen: set[tuple[tuple[Action, ...], ...]] = set()
    for cand in _candidates(n, m, k, bounds, weights, cost):
        if cand.actions in seen:
            continue
        seen.add(cand.actions)
        held = [cand.worker_held(w, weights) for w in range(k)]
        if any(h > b * (1 + 1e-9) for h, b in zip(held, bounds)):
            continue
        key = (_known_span(cand, cost, delays), max(held))
        if best is None or key < best[:2]:
            best = (*key, cand)
    assert best is not None  # the serial schedule fits any feasible budget
    s = best[2]
    peaks = tuple(s.worker_in_flight(w) for w in range(k))
    return Schedule("auto", s.n_stages, m, s.actions, s.placement, max_in_flight=peaks)


def _candidates(
    n: int, m: int, k: int, bounds: tuple[float, ...], weights: tuple[float, ...], cost: Cost
) -> Iterator[Schedule]:
    v = n // k
    for placement in _placements(n, k):
        top = _most_held(placement, bounds, weights, m)
        costs = (cost,) if cost is unit_cost else (cost, unit_cost)
        for split in (False, True):
            for reserve in (False, True) if v > 1 else (False,):
                for model in costs:
                    yield from _bounded(_series(placement, k, m, split, reserve, model), top)
        if v == 2 and placement == _v_placement(k):
            yield from _v_blocks(k, m)
        yield from _named(n, m, k, placement)


class _Series:
    """List scheduling of one placement under the uniform bounds 1, 2, ..., each order built
    when first asked for and kept, with the unbounded order.

    The orders depend on neither the budget nor the weights (those only say how far up the
    bounds go and which orders fit), so calls with other budgets or weights for the same
    stages and micro-batches (a search's recompute policies, shardings and lowered budgets)
    reuse them: list scheduling is most of the search's time."""

    def __init__(
        self, placement: tuple[int, ...], k: int, m: int, split: bool, reserve: bool, cost: Cost
    ) -> None:
        self.args = (placement, k, m, split, reserve, cost)
        self.free = _greedy(placement, k, m, len(placement) * m, split, reserve, cost)
        self.orders: list[Schedule | None] = []  # under bound c at [c - 1]

    def order(self, c: int) -> Schedule | None:
        """The order under bound ``c`` (None: it cannot progress under it)."""
        placement, k, m, split, reserve, cost = self.args
        while len(self.orders) < c:
            self.orders.append(_greedy(placement, k, m, len(self.orders) + 1, split, reserve, cost))
        return self.orders[c - 1]


@lru_cache(maxsize=32)  # a few calls' series: a series may hold thousands of actions per order
def _series(
    placement: tuple[int, ...], k: int, m: int, split: bool, reserve: bool, cost: Cost
) -> _Series:
    return _Series(placement, k, m, split, reserve, cost)


def _bounded(series: _Series, top: int) -> Iterator[Schedule]:
    """List scheduling under every uniform bound from 1 to ``top``, up to the first whose order
    is the unbounded one (a larger bound, then, has no say: the same order)."""
    free = series.free
    for c in range(1, top + 1):
        got = series.order(c)
        if got is not None:
            yield got
            if free is not None and got.actions == free.actions:
                return


@lru_cache(maxsize=64)
def _v_blocks(k: int, m: int) -> tuple[Schedule, ...]:
    """The V's building blocks of every style repeated over ``m`` micro-batches."""
    placement = _v_placement(k)
    return tuple(_orders_schedule(placement, m, repeated(v_block(k, st), k, m)) for st in STYLES)


def _greedy(
    placement: tuple[int, ...], k: int, m: int, c: int, split: bool, reserve: bool, cost: Cost
) -> Schedule | None:
    try:
        orders = greedy_orders(placement, k, m, (c,) * k, split=split, cost=cost, reserve=reserve)
    except ValueError:  # this order cannot progress under bound c
        return None
    return _orders_schedule(placement, m, orders)


def _named(n: int, m: int, k: int, placement: tuple[int, ...]) -> Iterator[Schedule]:
    """The named schedules laid out as ``placement``."""
    if n == k:
        yield from (one_f_one_b(k, m), zb_h1(k, m))
    elif placement == _v_placement(k):
        yield from (zb_v(n, m), v_half(n, m), v_min(n, m))
    else:
        yield interleaved_1f1b(n, m, n_workers=k)


def _most_held(
    placement: tuple[int, ...], bounds: tuple[float, ...], weights: tuple[float, ...], m: int
) -> int:
    """The largest uniform bound (stage micro-batches) any worker's budget could take: its
    budget over its lightest stage, at most all its stages' micro-batches."""
    most = 1
    for w, b in enumerate(bounds):
        mine = [weights[s] for s, o in enumerate(placement) if o == w]
        most = max(most, min(len(mine) * m, math.floor(b / min(mine) + 1e-9)))
    return most


def _placements(n: int, k: int) -> list[tuple[int, ...]]:
    looped = tuple(s % k for s in range(n))
    return [looped, _v_placement(k)] if n == 2 * k and k > 1 else [looped]


def _v_placement(k: int) -> tuple[int, ...]:
    return tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))


def _orders_schedule(
    placement: tuple[int, ...], m: int, orders: list[list[tuple[int, str, int]]]
) -> Schedule:
    actions = tuple(tuple(Action(s, kind, i) for s, kind, i in work) for work in orders)  # type: ignore[arg-type]
    return Schedule("auto", len(placement), m, actions, placement)


@lru_cache(maxsize=512)  # a candidate of one call is timed again by the next alike
def _known_span(schedule: Schedule, cost: Cost, delays: Delay) -> float:
    return _span(schedule, cost, delays)


def _span(schedule: Schedule, cost: Cost, delays: Delay) -> float:
    place = schedule.placement

    def delay(dep: Action, a: Action) -> float:
        if dep.stage == a.stage or place[dep.stage] == place[a.stage] or not delays:
            return 0.0
        return delays[min(dep.stage, a.stage)]

    finish = timed(schedule, lambda a, split: cost(a.stage, a.kind, split), transfer=delay)
    return max(finish.values(), default=0.0)


# -- arguments ---------------------------------------------------------------------------------
def _virtual(n: int, k: int) -> int:
    if k < 1 or n < k or n % k:
        raise ValueError(
            f"n_stages={n} is not a multiple of n_workers={k}; give each worker the same "
            "number of stages (e.g. balance with K or 2K entries)"
        )
    return n // k


def _weights(weight: Sequence[float] | None, n: int, v: int) -> list[float]:
    if weight is None:
        return [1.0 / v] * n
    got = [float(x) for x in weight]
    if len(got) != n or any(not x > 0 for x in got):
        raise ValueError(
            f"weight must give a positive number for each of the {n} stages, got {list(weight)}"
        )
    return got


def _bounds(budget: Budget, k: int, label: str) -> tuple[float, ...]:
    values = [budget] if isinstance(budget, (int, float)) else list(budget)
    if isinstance(budget, bool) or any(
        isinstance(b, bool) or not isinstance(b, (int, float)) for b in values
    ):
        raise TypeError(f"{label} must be a number or one per worker, got {budget!r}; e.g. 2")
    if len(values) == 1:
        values = values * k
    if len(values) != k:
        raise ValueError(
            f"{label} gives {len(values)} bounds for {k} workers; give one, or one per worker"
        )
    return tuple(float(b) for b in values)


def least_budget(n_stages: int, n_workers: int, weight: Sequence[float] | None = None) -> float:
    """The smallest budget (one for every worker) that some schedule keeps to: each worker
    holds one micro-batch on all its stages at once (its last stage's F comes before its first
    stage's B), in the placement where the heaviest worker is lightest.

    Example:
        >>> least_budget(4, 2), least_budget(4, 2, [3.0, 1.0, 1.0, 3.0])
        (1.0, 4.0)
    """
    v = _virtual(n_stages, n_workers)
    weights = _weights(weight, n_stages, v)
    return min(max(_least(p, weights, n_workers)) for p in _placements(n_stages, n_workers))


def _check_feasible(
    bounds: tuple[float, ...], weights: list[float], k: int, v: int, label: str
) -> None:
    """Some placement must fit one micro-batch on all of each worker's stages at once."""
    needs = [_least(p, weights, k) for p in _placements(len(weights), k)]
    if any(all(b >= n * (1 - 1e-9) for b, n in zip(bounds, need)) for need in needs):
        return
    need = min(needs, key=max)
    w = max(range(k), key=lambda j: need[j] - bounds[j])
    raise ValueError(
        f"{label}={_show(bounds[w])} is below what any schedule holds on worker {w}: "
        f"{_show(need[w])} (one micro-batch on each of its {v} stage(s) at once); pass "
        f"{label} >= {_show(max(need))}"
    )


def _least(placement: tuple[int, ...], weights: list[float], k: int) -> list[float]:
    return [sum(x for x, o in zip(weights, placement) if o == w) for w in range(k)]


def _show(x: float) -> str:
    return f"{x:g}"


def _default_cost(v: int) -> Cost:
    def cost(stage: int, kind: str, split: bool) -> float:
        return (2.0 if kind == "B" and not split else 1.0) / v

    return cost


def _delays(transfer: Sequence[float] | None) -> Delay:
    return () if transfer is None else tuple(float(t) for t in transfer)
