"""Exact search for the best contiguous split when a stage's cost depends on its position.

Stage peaks are not additive over layers (in-flight micro-batches depend on the stage index
under 1F1B, temporaries are maxima, storages crossing a boundary count on both sides), so
:func:`pipepar.partition` does not apply directly. This is the same min-max dynamic program over
``best[j][b]`` (the best bottleneck for the first ``b`` layers on ``j + 1`` stages), with the
stage oracle of :class:`~pipepar.stage_memory.MemoryModel` as the feasibility test. O(K * L^2)
oracle calls at most, each O(1); two exact prunings cut most of them: a stage's parameters,
gradients and optimizer state only grow as it takes more layers, and so does its time.

    >>> chosen = search(memory_model, targets, times=None)   # None: nothing fits
    >>> [len(c.layers) for c in chosen]                      # the balance
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pipepar.planner.plan_targets import Target
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["Candidate", "search", "unconstrained"]

_INF = math.inf


@dataclass(frozen=True)
class Candidate:
    """A chosen stage: its index, layers, predicted peak and overflow (peak - capacity)."""

    stage: int
    layers: range
    peak: int
    overflow: float


# objective(j, a, last) -> (value, peak), or None when the stage must not be chosen.
_Objective = Callable[[int, int, int], "tuple[float, int] | None"]


def search(
    model: MemoryModel, targets: list[Target], times: list[float] | None
) -> list[Candidate] | None:
    """The split minimizing the slowest stage's time (or, without times, the fullest stage).

    Args:
        model: the stage memory oracle.
        targets: one per stage, with capacities.
        times: per-layer times (ms), or None to balance memory.

    Returns:
        The stages, or None when no split fits the capacities.
    """
    if times is not None:
        prefix = [0.0]
        for t in times:
            prefix.append(prefix[-1] + t)
        return _dp(model, targets, _by_time(model, targets, prefix), monotone=True)
    return _dp(model, targets, _by_memory(model, targets), monotone=False)


def unconstrained(model: MemoryModel, targets: list[Target]) -> list[Candidate]:
    """The split with the smallest largest overflow, fitting or not (for error messages)."""

    def objective(j: int, a: int, last: int) -> tuple[float, int]:
        peak = model.stage(j, a, last).peak_bytes
        cap = targets[j].capacity
        return (peak - cap if cap is not None else -_INF), peak

    found = _dp(model, targets, objective, monotone=False, prune_static=False)
    assert found is not None  # no constraint, so something always comes out
    return found


def _by_time(model: MemoryModel, targets: list[Target], prefix: list[float]) -> _Objective:
    def objective(j: int, a: int, last: int) -> tuple[float, int] | None:
        peak = model.stage(j, a, last).peak_bytes
        cap = targets[j].capacity
        if cap is not None and peak > cap:
            return None
        return prefix[last + 1] - prefix[a], peak

    return objective


def _by_memory(model: MemoryModel, targets: list[Target]) -> _Objective:
    finite = [t.capacity for t in targets if t.capacity]
    reference = float(max(finite)) if finite else 1.0  # unlimited devices compare in bytes

    def objective(j: int, a: int, last: int) -> tuple[float, int] | None:
        peak = model.stage(j, a, last).peak_bytes
        cap = targets[j].capacity
        if cap is not None and peak > cap:
            return None
        return peak / (cap if cap else reference), peak

    return objective


def _dp(
    model: MemoryModel,
    targets: list[Target],
    objective: _Objective,
    *,
    monotone: bool,
    prune_static: bool = True,
) -> list[Candidate] | None:
    n, k = model.n_layers, len(targets)
    startable = model.startable  # a stage may not start with a layer that writes its input
    best = [0.0] + [_INF] * n  # best[b]: bottleneck of the first b layers on the stages so far
    picks: list[list[tuple[int, int]]] = []  # per stage, per end b: (start a, peak)
    for j in range(k):
        cap = targets[j].capacity
        new, pick = [_INF] * (n + 1), [(-1, 0)] * (n + 1)
        for b in range(j + 1, n - (k - 1 - j) + 1):
            for a in range(b - 1, j - 1, -1):  # the stage is layers a..b-1
                if prune_static and cap is not None and model.static_bytes(a, b - 1) > cap:
                    break  # more layers only add parameters
                if best[a] == _INF or not startable[a]:
                    continue
                found = objective(j, a, b - 1)
                if found is None:
                    continue
                value, peak = found
                if max(best[a], value) < new[b]:
                    new[b], pick[b] = max(best[a], value), (a, peak)
                elif monotone and value >= new[b]:
                    break  # a stage's time only grows as it takes more layers
        best = new
        picks.append(pick)
    if best[n] == _INF:
        return None
    return _backtrack(picks, targets, n)


def _backtrack(
    picks: list[list[tuple[int, int]]], targets: list[Target], n: int
) -> list[Candidate]:
    out, b = [], n
    for j in reversed(range(len(targets))):
        a, peak = picks[j][b]
        cap = targets[j].capacity
        out.append(Candidate(j, range(a, b), peak, peak - cap if cap is not None else -_INF))
        b = a
    return out[::-1]
