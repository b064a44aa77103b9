"""Placing recomputes (R) in a schedule's idle slots: where they land, the memory bound, errors."""

from __future__ import annotations

import pytest

from pipepar.core.named_schedules import make
from pipepar.core.recompute_placement import (
    check_placement,
    check_rebuilds,
    checkpointed,
    place_recomputes,
    placed_for,
    without_rebuilds,
)
from pipepar.core.schedule import Action, parse, timed, unit_costs, validate


def _slow_first(a: Action, split: bool) -> float:
    """Stage 0 takes twice as long as the others: the later workers idle before each F."""
    return (2.0 if a.kind == "B" and not split else 1.0) * (2.0 if a.stage == 0 else 1.0)


def _strs(actions: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in actions]


@pytest.mark.parametrize(
    ("name", "k", "v"),
    [("gpipe", 3, 1), ("1f1b", 3, 1), ("zb-h1", 3, 1), ("interleaved-1f1b", 2, 2), ("zb-v", 2, 2)],
)
def test_every_rebuilt_microbatch_gets_one_r_between_its_f_and_b(name: str, k: int, v: int) -> None:
    s = make(name, k * v, 6, n_workers=k)
    rebuilt = checkpointed(s, "except_last")
    placed = place_recomputes(s, rebuilt)
    validate(placed)
    listed = {(a.stage, a.microbatch) for w in placed.actions for a in w if a.kind == "R"}
    assert listed == rebuilt
    # Nothing else moved: without its R, each worker's list is the schedule's.
    assert [tuple(a for a in w if a.kind != "R") for w in placed.actions] == list(s.actions)
    # The default bound is what recomputing just before each B holds: no more memory.
    in_place = placed_for(s, "bubbles", "except_last")
    assert in_place == placed


def test_an_r_that_would_delay_its_b_moves_into_the_latest_idle_slot_that_holds_it() -> None:
    s = make("gpipe", 2, 4, n_workers=2)
    rebuilt = checkpointed(s, "always")
    just_before_b = place_recomputes(s, rebuilt, cost=_slow_first)  # bound 1: nowhere to go
    assert _strs(just_before_b.worker(1)) == [
        "F0", "F1", "F2", "F3", "R3", "B3", "R2", "B2", "R1", "B1", "R0", "B0"
    ]  # fmt: skip
    moved = place_recomputes(s, rebuilt, bound=2, cost=_slow_first)
    # Worker 1 waits 1 before each F (stage 0 is twice as slow): R2 fills the wait before F3,
    # the latest idle slot after F2.
    assert _strs(moved.worker(1)) == [
        "F0", "F1", "F2", "R2", "F3", "R3", "B3", "B2", "R1", "B1", "R0", "B0"
    ]  # fmt: skip
    validate(moved)
    span = {"in place": max(timed(just_before_b, _slow_first).values())}
    span["moved"] = max(timed(moved, _slow_first).values())
    assert span["moved"] < span["in place"]
    # Worker 0 waits 2 for B3's gradient after R3 (hidden there, it stays): R2 fills that
    # wait; then no idle slot is left for R1 and R0, which stay just before their B.
    assert _strs(moved.worker(0))[4:] == ["R3", "R2", "B3", "B2", "R1", "B1", "R0", "B0"]


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_no_worker_holds_more_rebuilt_microbatches_than_the_bound(bound: int) -> None:
    s = make("gpipe", 3, 6, n_workers=3)
    placed = place_recomputes(s, checkpointed(s, "always"), bound=bound, cost=_slow_first)
    assert max(placed.worker_rebuilt(w) for w in range(3)) <= bound
    validate(placed)


def test_a_looser_bound_never_lengthens_the_simulated_step() -> None:
    s = make("gpipe", 3, 6, n_workers=3)
    rebuilt = checkpointed(s, "always")
    spans = [
        max(timed(place_recomputes(s, rebuilt, bound=b, cost=_slow_first), _slow_first).values())
        for b in (1, 2, 4)
    ]
    assert spans == sorted(spans, reverse=True)


def test_listed_r_runs_while_b_waits_for_its_gradient() -> None:
    # Recomputing inside B (B costs F more) is slower than R listed before B, which runs while
    # the worker waits for the gradient.
    s = make("1f1b", 4, 8, n_workers=4)
    cost = unit_costs(1)

    def inside_b(a: Action, split: bool) -> float:
        return cost(a, split) + (1.0 if a.kind == "B" else 0.0)

    placed = place_recomputes(s, checkpointed(s, "always"))
    assert max(timed(placed, cost).values()) < max(timed(s, inside_b).values())


def test_bad_input_is_refused_with_the_fix() -> None:
    s = make("1f1b", 2, 2, n_workers=2)
    with pytest.raises(ValueError, match=r"rebuilt names \[\(2, 0\)\] but schedule '1f1b' has"):
        place_recomputes(s, {(2, 0)})
    with pytest.raises(ValueError, match="lists R actions already"):
        place_recomputes(place_recomputes(s, {(0, 0)}), {(0, 0)})
    zb = make("zb-v", 4, 4, n_workers=2)
    floor = place_recomputes(zb, checkpointed(zb, "always")).worker_rebuilt(0)
    assert floor > 1  # W after later B's: the graph is held until W
    with pytest.raises(ValueError, match=f"bound=1 on worker 0 but .* {floor} rebuilt"):
        place_recomputes(zb, checkpointed(zb, "always"), bound=1)
    with pytest.raises(ValueError, match="bound gives 3 values but the schedule has 2 workers"):
        place_recomputes(s, {(0, 0)}, bound=(1, 1, 1))
    with pytest.raises(TypeError, match="bound must be an int"):
        place_recomputes(s, {(0, 0)}, bound="2")  # type: ignore[arg-type]


def test_recompute_option_and_schedules_with_r_are_checked() -> None:
    assert check_placement("in_place", "never") == "in_place"
    with pytest.raises(ValueError, match="recompute must be one of 'in_place', 'bubbles'"):
        check_placement("idle", "always")
    with pytest.raises(ValueError, match="checkpoint='never' recomputes none"):
        check_placement("bubbles", "never")
    with_r = parse("F0 F1 R0 B0 R1 B1")
    with pytest.raises(ValueError, match="lists 0R1 but checkpoint='except_last' keeps"):
        check_rebuilds(with_r, "except_last")
    check_rebuilds(with_r, "always")
    assert placed_for(with_r, "in_place", "always") is with_r  # R listed: run as it is


def test_the_planner_refuses_a_schedule_with_r_rather_than_misprice_it() -> None:
    from pipepar.planner.peak_moments import schedule_for

    with_r = parse("F0 F1 R0 B0 R1 B1 | F0 F1 R0 B0 R1 B1")
    with pytest.raises(ValueError, match="memory model counts the recompute inside B, but"):
        schedule_for(with_r, 2, 2)
    plain = make("1f1b", 2, 2, n_workers=2)
    assert without_rebuilds(plain, "x") is plain
