"""A schedule built for a memory budget: within the budget by the schedule's own accounting,
never slower than 1F1B (or ZB-V, with a V allowed) at their memory, never slower with more
budget, and a clear error below what any schedule can hold (no process group)."""

from __future__ import annotations

import pytest

from pipepar.core.named_schedules import one_f_one_b, zb_v
from pipepar.core.schedule import validate
from pipepar.core.schedule_budget import budget_schedule, makespan, one_f_one_b_held
from pipepar.core.schedule_greedy import Cost


def _uneven(stage: int, kind: str, split: bool) -> float:
    """Stages of unequal speed, W cheaper than B, stage 0's B nearly free."""
    f = 1.0 + 0.3 * (stage % 3)
    if kind == "F":
        return f
    if kind == "W":
        return 0.8 * f
    if stage == 0 and split:
        return 0.1
    return (1.8 if not split else 1.0) * f


COSTS: list[Cost | None] = [None, _uneven]
SIZES = [(2, 4), (2, 8), (3, 6), (4, 8)]


def _held(s, weight: list[float]) -> float:  # type: ignore[no-untyped-def]
    return max(s.worker_held(w, weight) for w in range(s.n_workers))


@pytest.mark.parametrize("k, m", SIZES)
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("fraction", [0.5, 0.75, 1.0])
@pytest.mark.parametrize("cost", COSTS)
def test_the_schedule_holds_at_most_its_budget(
    k: int, m: int, v: int, fraction: float, cost: Cost | None
) -> None:
    budget = max(1.0, fraction * one_f_one_b_held(k, m))
    s = budget_schedule(v * k, m, n_workers=k, budget=budget, cost=cost)
    validate(s)  # complete, no deadlock, within its own max_in_flight
    assert s.name == "auto" and s.n_workers == k and s.n_stages == v * k
    assert _held(s, [1 / v] * (v * k)) <= budget


@pytest.mark.parametrize("k, m", SIZES)
@pytest.mark.parametrize("cost", COSTS)
def test_at_1f1bs_memory_never_slower_than_1f1b(k: int, m: int, cost: Cost | None) -> None:
    s = budget_schedule(k, m, n_workers=k, budget=one_f_one_b_held(k, m), cost=cost)
    assert makespan(s, cost) <= makespan(one_f_one_b(k, m), cost)


@pytest.mark.parametrize("k, m", SIZES)
@pytest.mark.parametrize("cost", COSTS)
def test_with_a_v_at_1f1bs_memory_as_fast_as_zb_v(k: int, m: int, cost: Cost | None) -> None:
    s = budget_schedule(2 * k, m, n_workers=k, budget=one_f_one_b_held(k, m), cost=cost)
    assert makespan(s, cost) <= makespan(zb_v(2 * k, m), cost)


@pytest.mark.parametrize("k, m", SIZES)
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("cost", COSTS)
def test_more_budget_is_never_slower(k: int, m: int, v: int, cost: Cost | None) -> None:
    spans = [
        makespan(budget_schedule(v * k, m, n_workers=k, budget=b, cost=cost), cost)
        for b in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0)
    ]
    assert spans == sorted(spans, reverse=True)
    assert spans[0] > spans[-1]  # the budget matters: the serial order is slower


def test_a_budget_in_bytes_weighs_each_stage_by_its_activations() -> None:
    weight = [300.0, 100.0, 100.0, 300.0]  # V over 2 workers: 400 bytes per micro-batch each
    s = budget_schedule(4, 8, n_workers=2, budget=1000, weight=weight)
    assert _held(s, weight) <= 1000
    tight = budget_schedule(4, 8, n_workers=2, budget=400, weight=weight)
    assert _held(tight, weight) <= 400 and makespan(tight) > makespan(s)


def test_a_budget_per_worker_binds_each_worker() -> None:
    s = budget_schedule(4, 8, n_workers=4, budget=(2, 1, 1, 1))
    assert [s.worker_held(w, [1.0] * 4) for w in range(4)] <= [2.0, 1.0, 1.0, 1.0]
    assert all(s.worker_held(w, [1.0] * 4) <= b for w, b in enumerate((2, 1, 1, 1)))


def test_transfer_times_are_in_the_makespan_it_minimises() -> None:
    transfer = [2.0, 2.0, 2.0]
    s = budget_schedule(4, 8, n_workers=4, budget=4, transfer=transfer)
    assert makespan(s, transfer=transfer) <= makespan(one_f_one_b(4, 8), transfer=transfer)
    assert makespan(s, transfer=transfer) > makespan(s)


@pytest.mark.parametrize(
    "n, budget, weight, least",
    [(2, 0.5, None, "1"), (4, 0.9, None, "1"), (4, 350, [300.0, 100.0, 100.0, 300.0], "400")],
)
def test_a_budget_below_any_schedule_names_the_smallest(
    n: int, budget: float, weight: list[float] | None, least: str
) -> None:
    with pytest.raises(ValueError, match=rf"budget={budget:g} is below .* budget >= {least}$"):
        budget_schedule(n, 8, n_workers=2, budget=budget, weight=weight)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="n_stages=3 is not a multiple of n_workers=2"):
        budget_schedule(3, 4, n_workers=2, budget=2)
    with pytest.raises(ValueError, match="budget gives 3 bounds for 2 workers"):
        budget_schedule(2, 4, n_workers=2, budget=(1, 2, 3))
    with pytest.raises(TypeError, match="memory_budget must be a number"):
        budget_schedule(2, 4, n_workers=2, budget="2", label="memory_budget")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight must give a positive number for each of the 2"):
        budget_schedule(2, 4, n_workers=2, budget=2, weight=[1.0])
