"""Derive per-worker action orders by list scheduling on a simulated clock.

Zero-bubble and virtual-stage schedules have no short closed form that fits every K, M and
placement; like the zero-bubble paper's own scheduler, we build them by simulation. Each
action takes a cost (by default F = 1, B = 1, W = 1, or 2 for a whole backward; the caller may
give its own); whenever a worker is free it starts, among the actions whose inputs have arrived:

1. a backward B (it unblocks the previous stage: the critical path), earliest micro-batch first;
2. else a forward F if the worker holds fewer micro-batches than its bound (memory), the
   deepest stage first (it reaches the backward sooner); with ``reserve``, a micro-batch enters
   a worker (F on its first stage there) only if the bound has room for it on every stage of the
   worker it will pass, so that a V's way back always finds room (a worker full of micro-batches
   on its first stage would wait forever for room on its last);
3. else a deferred weight-gradient W (filling time that would be idle).

The result is a plain order per worker; :mod:`pipepar.core.schedule` wraps it as a Schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Cost", "greedy_orders", "unit_cost"]

_NEVER = float("inf")  # the finish of an action not yet run

Op = tuple[int, str, int]  # (stage, kind, micro-batch)
Cost = Callable[[int, str, bool], float]
"""``cost(stage, kind, split)``: how long the list scheduler takes an action to run."""


def unit_cost(stage: int, kind: str, split: bool) -> float:
    """F = B = W = 1, a whole backward 2."""
    return 2.0 if kind == "B" and not split else 1.0


@dataclass
class _Worker:
    stages: list[int]
    bound: int
    clock: float = 0.0
    held: int = 0
    order: list[Op] = field(default_factory=list)
    weights: list[Op] = field(default_factory=list)  # W's not yet run, oldest first
    left: int = 0  # actions not yet run


@dataclass
class _State:
    placement: tuple[int, ...]
    m: int
    split: bool
    cost: Cost = unit_cost
    reserve: bool = False
    finish: dict[Op, float] = field(default_factory=dict)
    next_f: dict[int, int] = field(default_factory=dict)  # stage -> next micro-batch forward
    next_b: dict[int, int] = field(default_factory=dict)  # stage -> next micro-batch backward


def greedy_orders(
    placement: tuple[int, ...],
    k: int,
    m: int,
    bound: tuple[int, ...],
    *,
    split: bool,
    cost: Cost = unit_cost,
    reserve: bool = False,
) -> list[list[Op]]:
    """Per-worker orders of ``(stage, kind, micro-batch)`` for stages placed by ``placement``.

    Args:
        placement: the worker of each stage.
        k: number of workers.
        m: micro-batches.
        bound: per worker, the most stage micro-batches held between F and last backward.
        split: split every backward into B (input gradient) and a deferred W.
        cost: the time each action takes on the simulated clock (default :func:`unit_cost`).
        reserve: count a micro-batch on all the worker's stages from its first F there.

    Example:
        >>> first, last = greedy_orders((0, 1), 2, 2, (2, 1), split=False)
        >>> first
        [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)]
        >>> last
        [(1, 'F', 0), (1, 'B', 0), (1, 'F', 1), (1, 'B', 1)]
    """
    state = _State(placement, m, split, cost, reserve)
    workers = [
        _Worker([s for s, w in enumerate(placement) if w == j], max(1, bound[j])) for j in range(k)
    ]
    for wk in workers:
        wk.left = len(wk.stages) * m * (3 if split else 2)
    for _ in range(sum(wk.left for wk in workers)):  # one action run each time round
        busy = [wk for wk in workers if wk.left]
        first = _first_runnable(busy, state)
        while first is None:  # no worker free first can start one: on to the next event
            t = min(wk.clock for wk in busy)
            later = _next_event(t, state, busy)
            for wk in busy:
                if wk.clock == t:
                    wk.clock = later
            first = _first_runnable(busy, state)
        _run(*first, state)
    return [wk.order for wk in workers]


def _first_runnable(busy: list[_Worker], state: _State) -> tuple[_Worker, Op] | None:
    """The first of the workers free first (in worker order) that can start an action, and
    that action; None if none can."""
    t = min(wk.clock for wk in busy)
    for wk in busy:
        if wk.clock == t:
            op = _pick(wk, state)
            if op is not None:
                return wk, op
    return None


def _pick(worker: _Worker, state: _State) -> Op | None:
    t, last, m, finish = worker.clock, len(state.placement) - 1, state.m, state.finish
    back: tuple[int, int] | None = None  # (micro-batch, -stage): the earliest, then deepest
    for s in worker.stages:
        i = state.next_b.get(s, 0)
        if i < m and finish.get((s, "F", i), _NEVER) <= t:
            dep = (s, "F", i) if s == last else (s + 1, "B", i)
            if finish.get(dep, _NEVER) <= t and (back is None or (i, -s) < back):
                back = (i, -s)
    if back is not None:
        return (-back[1], "B", back[0])
    deepest: Op | None = None
    for s in worker.stages:  # the deepest stage whose next forward can start
        i = state.next_f.get(s, 0)
        if (
            i < m
            and (s == 0 or finish.get((s - 1, "F", i), _NEVER) <= t)
            and _room(worker, s, state)
            and (deepest is None or s > deepest[0])
        ):
            deepest = (s, "F", i)
    if deepest is not None:
        return deepest
    return worker.weights[0] if worker.weights else None


def _room(worker: _Worker, s: int, state: _State) -> bool:
    """Whether the bound lets stage ``s`` of the worker take a micro-batch in."""
    if not state.reserve:
        return worker.held < worker.bound
    return s != worker.stages[0] or worker.held + len(worker.stages) <= worker.bound


def _taken(worker: _Worker, s: int, state: _State) -> int:
    """Micro-batches an F on stage ``s`` adds to the worker's count."""
    if not state.reserve:
        return 1
    return len(worker.stages) if s == worker.stages[0] else 0


def _run(worker: _Worker, op: Op, state: _State) -> None:
    s, kind, i = op
    worker.clock += state.cost(s, kind, state.split)
    state.finish[op] = worker.clock
    worker.order.append(op)
    worker.left -= 1
    if kind == "F":
        worker.held += _taken(worker, s, state)
        state.next_f[s] = i + 1
    elif kind == "B":
        state.next_b[s] = i + 1
        if state.split:
            worker.weights.append((s, "W", i))
        else:
            worker.held -= 1
    else:
        worker.weights.remove(op)
        worker.held -= 1


def _next_event(t: float, state: _State, busy: list[_Worker]) -> float:
    later = [f for f in state.finish.values() if f > t] + [wk.clock for wk in busy if wk.clock > t]
    if not later:
        raise ValueError(
            "the schedule cannot progress under its memory bound; raise the bound (micro-batches "
            "in flight per worker)"
        )
    return min(later)
