"""Exact min-max contiguous partition of a cost list, with per-part capacities.

Split ``costs`` into ``parts`` non-empty contiguous runs so that the largest run sum (the
pipeline's bottleneck) is as small as possible, subject to run ``j``'s sum fitting
``capacity[j]``. torchgpipe's ``balance_by_time`` uses a block-partition heuristic that can be
1.3-1.7x off; this is exact.

Algorithm: dynamic programming over ``best[j][b]`` = the smallest bottleneck that puts the
first ``b`` costs into ``j`` parts. For a fixed end ``b``, the cost of the last part falls as its
start moves right while ``best[j-1][start]`` rises, so the optimum sits where the two curves
cross and a binary search finds it: O(parts * n log n) instead of O(parts * n^2).

    >>> partition([1, 1, 1, 1, 4], 2)
    [4, 1]
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["partition"]

_INF = math.inf


def partition(
    costs: Sequence[float],
    parts: int,
    *,
    capacity: float | Sequence[float | None] | None = None,
) -> list[int]:
    """Split ``costs`` into ``parts`` contiguous runs minimizing the largest run sum.

    Args:
        costs: non-negative cost per item (layer times, bytes, ...).
        parts: number of runs (stages); at most ``len(costs)``.
        capacity: the most each run may sum to: one number for all runs, one per run
            (heterogeneous devices; None entries mean unlimited), or None for no limit.

    Returns:
        The balance: how many items go in each run, in order.

    Raises:
        ValueError: bad arguments, or no split fits the capacities; the message says which
            item or run is too big and by how much.

    Example:
        >>> partition([3, 3, 3, 3], 2)
        [2, 2]
        >>> partition([3, 3, 3, 3], 2, capacity=[3, 100])
        [1, 3]
    """
    values = _check_costs(costs)
    _check_parts(parts, len(values))
    caps = _capacities(capacity, parts)
    prefix = [0.0, *accumulate(values)]
    ends = _solve(prefix, parts, caps)
    if ends is None:
        raise ValueError(_explain_misfit(values, parts, caps, prefix))
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


def _check_costs(costs: Sequence[float]) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs must be a sequence of numbers, got {type(costs).__name__}")
    values: list[float] = []
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise TypeError(f"costs[{i}]={c!r} is not a number; pass one number per layer")
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}]={c!r} must be finite and >= 0")
        values.append(float(c))
    if not values:
        raise ValueError("costs is empty; pass one cost per layer")
    return values


def _check_parts(parts: int, n: int) -> None:
    if isinstance(parts, bool) or not isinstance(parts, numbers.Integral):
        raise TypeError(f"parts must be an int, got {type(parts).__name__} {parts!r}")
    if not 1 <= parts <= n:
        raise ValueError(
            f"parts={parts} but there are {n} costs; every part needs at least one item, "
            f"so use 1 <= parts <= {n}"
        )


def _capacities(capacity: float | Sequence[float | None] | None, parts: int) -> list[float]:
    if capacity is None:
        return [_INF] * parts
    if isinstance(capacity, numbers.Real) and not isinstance(capacity, bool):
        return [_check_cap(capacity, "capacity")] * parts
    if isinstance(capacity, Sequence) and not isinstance(capacity, str):
        if len(capacity) != parts:
            raise ValueError(
                f"capacity has {len(capacity)} entries but parts={parts}; "
                "give one capacity per part, or a single number for all"
            )
        return [
            _INF if c is None else _check_cap(c, f"capacity[{j}]") for j, c in enumerate(capacity)
        ]
    raise TypeError(f"capacity must be a number, a sequence or None, got {capacity!r}")


def _check_cap(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0; use None or math.inf for no limit")
    return float(value)


def _solve(prefix: list[float], parts: int, caps: list[float]) -> list[int] | None:
    """Run ends (exclusive) of an optimal split, or None when nothing fits."""
    n = len(prefix) - 1
    # Equal capacities keep best[] monotone (see _crossing); unequal ones need a full scan.
    search = _crossing if len(set(caps)) == 1 else _scan
    # best[b]: smallest bottleneck for the first b items in the parts so far; choice[j][b]: start
    best = [0.0] + [_INF] * n
    choice: list[list[int]] = []
    for j in range(parts):
        new = [_INF] * (n + 1)
        pick = [-1] * (n + 1)
        for b in range(j + 1, n - (parts - j - 1) + 1):
            # Starts a in [lo, b-1]: part j is items a..b-1, preceded by j parts over a items.
            lo = _first_fitting_start(prefix, b, caps[j], j)
            if lo is None:
                continue
            a, value = search(prefix, best, lo, b)
            new[b], pick[b] = value, a
        best = new
        choice.append(pick)
    if best[n] == _INF:
        return None
    ends, b = [], n
    for j in reversed(range(parts)):
        ends.append(b)
        b = choice[j][b]
    return ends[::-1]


def _first_fitting_start(prefix: list[float], b: int, cap: float, j: int) -> int | None:
    """Smallest start a >= j with sum(items a..b-1) <= cap, or None."""
    # prefix[b] - prefix[a] <= cap  <=>  prefix[a] >= prefix[b] - cap
    a = bisect.bisect_left(prefix, prefix[b] - cap, lo=j, hi=b)
    return a if a < b else None


def _scan(prefix: list[float], best: list[float], lo: int, b: int) -> tuple[int, float]:
    """argmin over a in [lo, b-1] of max(best[a], sum(a..b-1)), by trying every a."""
    a = min(range(lo, b), key=lambda k: (max(best[k], prefix[b] - prefix[k]), -k))
    return a, max(best[a], prefix[b] - prefix[a])


def _crossing(prefix: list[float], best: list[float], lo: int, b: int) -> tuple[int, float]:
    """argmin over a in [lo, b-1] of max(best[a], sum(a..b-1)), by binary search.

    With one capacity for all parts, ``best[a]`` is non-decreasing in ``a`` (drop the last
    items of a split of more items: a part left empty takes the last item of the part before
    it, which fits since that part did), infinite past the first item too big to fit; the run
    sum is non-increasing in ``a``. So the optimum is where the two curves cross.
    """

    def cost(a: int) -> float:
        return max(best[a], prefix[b] - prefix[a])

    # Skip starts whose prefix cannot be split (infinite best) on the left side.
    left, right = lo, b - 1
    while left < right and best[left] == _INF:
        mid = (left + right) // 2
        if best[mid] == _INF:
            left = mid + 1
        else:
            right = mid
    right = b - 1
    # First a where best[a] >= run sum; the optimum is there or just before it.
    i, j = left, right
    while i < j:
        mid = (i + j) // 2
        if best[mid] >= prefix[b] - prefix[mid]:
            j = mid
        else:
            i = mid + 1
    candidates = [a for a in (i - 1, i) if left <= a <= right]
    a = min(candidates, key=lambda k: (cost(k), -k))
    return a, cost(a)


def _explain_misfit(values: list[float], parts: int, caps: list[float], prefix: list[float]) -> str:
    biggest = max(range(len(values)), key=values.__getitem__)
    top = max(caps)
    if values[biggest] > top:
        return (
            f"costs[{biggest}]={values[biggest]:g} is larger than every capacity (the largest "
            f"is {top:g}, short by {values[biggest] - top:g}); raise the capacity or split "
            "that item"
        )
    free = _solve(prefix, parts, [_INF] * parts)
    assert free is not None  # parts <= n was checked
    starts = [0, *free[:-1]]
    sums = [prefix[b] - prefix[a] for a, b in zip(starts, free)]
    over = max(range(parts), key=lambda j: sums[j] - caps[j])
    balance = [b - a for a, b in zip(starts, free)]
    return (
        f"no split of {len(values)} costs into {parts} parts fits the capacities {caps}; "
        f"the best unconstrained split {balance} overflows part {over} "
        f"({sums[over]:g} > {caps[over]:g}, by {sums[over] - caps[over]:g}); "
        "raise the capacities or use more parts"
    )
