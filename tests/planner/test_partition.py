"""Exact min-max contiguous partition: optimality against brute force, capacities, errors."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipepar
from pipepar.planner.partition import partition


def _sums(costs: list[float], balance: list[int]) -> list[float]:
    ends = list(itertools.accumulate(balance))
    return [sum(costs[a:b]) for a, b in zip([0, *ends[:-1]], ends)]


def _brute(costs: list[float], parts: int, caps: list[float]) -> float:
    """Smallest bottleneck over every contiguous split that fits (inf when none does)."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        sums = [sum(costs[bounds[i] : bounds[i + 1]]) for i in range(parts)]
        if all(s <= c for s, c in zip(sums, caps)):
            best = min(best, max(sums))
    return best


def _check(costs: list[float], parts: int, capacity: object, caps: list[float]) -> None:
    want = _brute(costs, parts, caps)
    if want == math.inf:
        with pytest.raises(ValueError):
            partition(costs, parts, capacity=capacity)  # type: ignore[arg-type]
        return
    balance = partition(costs, parts, capacity=capacity)  # type: ignore[arg-type]
    sums = _sums(costs, balance)
    assert len(balance) == parts and sum(balance) == len(costs) and min(balance) >= 1
    assert all(s <= c + 1e-9 for s, c in zip(sums, caps))
    assert max(sums) == pytest.approx(want, abs=1e-9)


def test_exported_from_package() -> None:
    assert pipepar.partition is partition


def test_optimal_against_brute_force_on_many_random_lists() -> None:
    rng = random.Random(1234)
    for _ in range(1500):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [
            rng.choice([0, 0, 1, 2, 3, 5, 8, 13, round(rng.random() * 10, 3)]) for _ in range(n)
        ]
        kind = rng.random()
        if kind < 0.4:
            _check(costs, parts, None, [math.inf] * parts)
        elif kind < 0.7:
            cap = rng.uniform(0, 30)
            _check(costs, parts, cap, [cap] * parts)
        else:
            caps = [rng.choice([math.inf, rng.uniform(0, 30)]) for _ in range(parts)]
            given_caps = [None if c == math.inf else c for c in caps]
            _check(costs, parts, given_caps, caps)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=8),
)
def test_optimal_property(costs: list[int], parts: int) -> None:
    parts = min(parts, len(costs))
    _check([float(c) for c in costs], parts, None, [math.inf] * parts)


def test_beats_block_partition_heuristic_case() -> None:
    # A skewed case where splitting by equal counts is 2x off the optimum.
    costs = [1, 1, 1, 1, 1, 1, 6, 6]
    assert max(_sums(costs, partition(costs, 2))) == 12
    assert max(_sums(costs, [4, 4])) == 14
    assert partition(costs, 3) == [6, 1, 1]


def test_heterogeneous_capacities_move_work_to_the_big_device() -> None:
    costs = [3, 3, 3, 3]
    assert partition(costs, 2) == [2, 2]
    assert partition(costs, 2, capacity=[3, 100]) == [1, 3]
    assert partition(costs, 2, capacity=[None, 3]) == [3, 1]


def test_too_big_item_is_named_with_the_shortfall() -> None:
    with pytest.raises(ValueError, match=r"costs\[1\]=9 is larger than every capacity") as err:
        partition([1, 9, 1], 2, capacity=5)
    assert "short by 4" in str(err.value)


def test_no_fitting_split_names_the_overflowing_part() -> None:
    with pytest.raises(ValueError, match=r"overflows part 1 \(6 > 5, by 1\)"):
        partition([3, 3, 3, 3], 2, capacity=[7, 5])


@pytest.mark.parametrize(
    ("costs", "parts", "kwargs", "error", "match"),
    [
        ([], 1, {}, ValueError, "costs is empty"),
        ([1, 2], 3, {}, ValueError, "parts=3 but there are 2 costs"),
        ([1, 2], 0, {}, ValueError, "1 <= parts <= 2"),
        ([1, -2], 1, {}, ValueError, r"costs\[1\]=-2 must be finite and >= 0"),
        ([1, math.nan], 1, {}, ValueError, "finite"),
        ([1, "x"], 1, {}, TypeError, "is not a number"),
        ("12", 1, {}, TypeError, "sequence of numbers"),
        ([1, 2], 1.5, {}, TypeError, "parts must be an int"),
        ([1, 2], 2, {"capacity": [1]}, ValueError, "capacity has 1 entries but parts=2"),
        ([1, 2], 2, {"capacity": -1}, ValueError, "must be >= 0"),
    ],
)
def test_bad_arguments(costs: object, parts: object, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        partition(costs, parts, **kwargs)  # type: ignore[arg-type]


def test_large_inputs_are_fast() -> None:
    rng = random.Random(7)
    costs = [rng.random() for _ in range(2000)]
    start = time.perf_counter()
    balance = partition(costs, 16)
    assert time.perf_counter() - start < 2.0
    # Exactness at scale: no single boundary move improves the bottleneck.
    best = max(_sums(costs, balance))
    for j in range(15):
        for delta in (-1, 1):
            moved = list(balance)
            moved[j] += delta
            moved[j + 1] -= delta
            if min(moved) >= 1:
                assert max(_sums(costs, moved)) >= best - 1e-12
