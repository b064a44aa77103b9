"""Schedules as data: builders, grid, in-flight counts and the validator (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipepar.core.named_schedules import (
    NAMES,
    VIRTUAL,
    gpipe,
    interleaved_1f1b,
    make,
    one_f_one_b,
    v_half,
    v_min,
    zb_h1,
    zb_v,
)
from pipepar.core.schedule import Action, Schedule, parse, simulate, validate

sizes = st.tuples(st.integers(1, 6), st.integers(1, 12))


def _strs(actions: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in actions]


def test_gpipe_runs_all_forwards_then_backwards_in_reverse() -> None:
    s = gpipe(3, 4)
    for j in range(3):
        assert _strs(s.stage(j)) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
        assert all(a.stage == j for a in s.stage(j))


def test_1f1b_warm_up_steady_state_and_cool_down() -> None:
    s = one_f_one_b(3, 5)
    assert _strs(s.stage(0)) == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]
    assert _strs(s.stage(1)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "B4"]
    assert _strs(s.stage(2)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4"]


def test_1f1b_with_fewer_microbatches_than_stages() -> None:
    s = one_f_one_b(4, 2)
    assert _strs(s.stage(0)) == ["F0", "F1", "B0", "B1"]
    validate(s)


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_builders_are_valid_and_have_the_documented_in_flight(size: tuple[int, int]) -> None:
    n, m = size
    for s in (gpipe(n, m), one_f_one_b(n, m)):
        validate(s)
    assert [gpipe(n, m).in_flight(j) for j in range(n)] == [m] * n
    assert [one_f_one_b(n, m).in_flight(j) for j in range(n)] == [min(n - j, m) for j in range(n)]


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_bubble_matches_the_formula(size: tuple[int, int]) -> None:
    n, m = size
    expected = (n - 1) / (m + n - 1)
    assert gpipe(n, m).bubble() == pytest.approx(expected)
    assert one_f_one_b(n, m).bubble() == pytest.approx(expected)


def test_simulate_respects_cross_stage_dependencies() -> None:
    s = one_f_one_b(3, 6)
    finished: dict[tuple[int, str, int], int] = {}
    for t, row in enumerate(simulate(s)):
        for a in row:
            if a is not None:
                finished[(a.stage, a.kind, a.microbatch)] = t
    for (j, kind, i), t in finished.items():
        if kind == "F" and j > 0:
            assert finished[(j - 1, "F", i)] < t
        if kind == "B" and j < 2:
            assert finished[(j + 1, "B", i)] < t
        if kind == "B":
            assert finished[(j, "F", i)] < t
    assert len(finished) == 3 * 6 * 2


def test_grid_prints_one_row_per_step_and_one_column_per_worker() -> None:
    s = gpipe(2, 2)
    lines = s.grid().splitlines()
    assert lines[0].split() == ["step", "worker0", "worker1"]
    assert len(lines) == 1 + len(simulate(s))
    assert lines[1].split() == ["0", "F0", "."]
    assert lines[2].split() == ["1", "F1", "F0"]
    assert str(s) == s.grid()


def test_parse_reads_per_stage_lists() -> None:
    s = parse("F0 F1 B0 B1 | F0 B0 F1 B1")
    assert (s.n_stages, s.n_microbatches) == (2, 2)
    assert _strs(s.stage(1)) == ["F0", "B0", "F1", "B1"]
    assert repr(s.stage(1)[1]) == "1B0"
    validate(s)
    with pytest.raises(ValueError, match="cannot read action 'X1'"):
        parse(["F0 X1"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F0 F1 B0 | F0 B0 F1 B1", "never runs B1"),
        ("F0 F0 B0 | F0 B0", "runs F0 twice"),
        ("B0 F0 | F0 B0", "runs B0 before F0"),
        ("F0 B0 F1 B1 | F0 F1 B0 B1", "deadlocks at step 2: 0B0, 1F1"),
    ],
)
def test_validator_rejects_broken_schedules(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(parse(text))


def test_validator_rejects_an_action_listed_on_the_wrong_stage() -> None:
    good = gpipe(2, 1)
    moved = (good.actions[0], (Action(0, "F", 0), Action(1, "B", 0)))
    with pytest.raises(ValueError, match="stage 0 is not placed on worker 1"):
        validate(dataclasses.replace(good, actions=moved))


def test_validator_enforces_the_in_flight_bound() -> None:
    as_gpipe = gpipe(2, 4)
    over = dataclasses.replace(as_gpipe, max_in_flight=one_f_one_b(2, 4).max_in_flight)
    with pytest.raises(ValueError, match="holds 4 micro-batches at once but the schedule allows 2"):
        validate(over)


def test_validator_checks_the_number_of_stage_lists() -> None:
    s = Schedule("x", 3, 1, gpipe(2, 1).actions)
    with pytest.raises(ValueError, match=r"stage\(s\) \[2\] are placed on workers"):
        validate(s)


@pytest.mark.parametrize("bad", [0, -1])
def test_builders_reject_bad_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="n_stages must be at least 1"):
        gpipe(bad, 4)
    with pytest.raises(ValueError, match="n_microbatches must be at least 1"):
        one_f_one_b(2, bad)
    with pytest.raises(TypeError, match="n_stages must be an int"):
        gpipe(2.0, 4)  # type: ignore[arg-type]


# -- zero-bubble and virtual-stage schedules -------------------------------------------------------
def _all(k: int, m: int) -> list[Schedule]:
    return [
        gpipe(k, m),
        one_f_one_b(k, m),
        zb_h1(k, m),
        interleaved_1f1b(2 * k, m, n_workers=k),
        zb_v(2 * k, m),
        v_half(2 * k, m),
        v_min(2 * k, m),
    ]


@settings(max_examples=30, deadline=None)
@given(sizes)
def test_every_builtin_schedule_validates_for_any_size(size: tuple[int, int]) -> None:
    k, m = size
    for s in _all(k, m):
        validate(s)
        assert sorted(a.microbatch for a in s.stage(0) if a.kind == "F") == list(range(m))


@settings(max_examples=30, deadline=None)
@given(sizes)
def test_zero_bubble_splits_every_backward_and_keeps_1f1b_memory(size: tuple[int, int]) -> None:
    k, m = size
    zb, ref = zb_h1(k, m), one_f_one_b(k, m)
    for j in range(k):
        assert all(zb.splits_backward(j, i) for i in range(m))
        assert zb.in_flight(j) <= ref.in_flight(j) == min(k - j, m)
        kinds = [a.kind for a in zb.stage(j)]
        assert kinds.count("W") == kinds.count("B") == kinds.count("F") == m


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_bubbles_shrink_from_1f1b_to_zb_h1_to_zb_v(k: int, m: int) -> None:
    assert one_f_one_b(k, m).bubble() == pytest.approx((k - 1) / (m + k - 1))
    assert zb_v(2 * k, m).bubble() < zb_h1(k, m).bubble() < one_f_one_b(k, m).bubble()


def test_zb_v_places_a_v_and_holds_what_1f1b_stage_0_holds() -> None:
    s = zb_v(6, 8)
    assert s.n_workers == 3
    assert [s.stages_of(w) for w in range(3)] == [[0, 5], [1, 4], [2, 3]]
    for w in range(3):  # half-size stages: 2K of them are K full-stage micro-batches
        assert s.worker_in_flight(w) <= 2 * 3


def test_interleaved_loops_stages_over_workers() -> None:
    s = interleaved_1f1b(6, 6, n_workers=3)
    assert list(s.placement) == [0, 1, 2, 0, 1, 2]
    assert s.virtual == 2
    assert all(not s.splits_backward(st_, i) for st_ in range(6) for i in range(6))


def test_make_builds_every_name_and_lists_them_for_a_typo() -> None:
    for name in NAMES:
        n = 4 if name in VIRTUAL else 2
        assert make(name, n, 4, n_workers=2).name == name
    with pytest.raises(ValueError, match=r"one of \['gpipe', '1f1b', 'zb-h1'"):
        make("zero-bubble", 2, 4, n_workers=2)


def test_make_names_the_balance_a_virtual_schedule_needs() -> None:
    with pytest.raises(ValueError, match="pass balance with 4 entries"):
        make("zb-v", 2, 4, n_workers=2)
    with pytest.raises(ValueError, match="multiple of 2 entries"):
        make("zb-v", 3, 4, n_workers=1)


def test_make_checks_a_given_schedule_against_the_pipe() -> None:
    with pytest.raises(ValueError, match="for 2 stages x 4 micro-batches on 2 workers"):
        make(gpipe(2, 4), 2, 8, n_workers=2)
    assert make(gpipe(2, 4), 2, 4, n_workers=2).name == "gpipe"


def test_validator_wants_w_after_its_b() -> None:
    with pytest.raises(ValueError, match="runs W0 before B0"):
        validate(parse("F0 W0 B0"))
    validate(parse("F0 B0 W0"))


def test_parse_reads_virtual_stages_and_weight_actions() -> None:
    s = parse("0F0 3F0 3B0 0B0 3W0 0W0 | 1F0 2F0 2B0 1B0 2W0 1W0")
    assert s.stages_of(0) == [0, 3] and s.stages_of(1) == [1, 2]
    assert s.splits_backward(3, 0) and s.virtual == 2
    validate(s)
    with pytest.raises(ValueError, match="appears on workers 0 and 1"):
        parse("0F0 0B0 | 0F0 0B0")


def test_a_v_schedule_deadlocking_is_reported() -> None:
    with pytest.raises(ValueError, match="deadlocks"):
        validate(parse("0F0 3F0 3B0 0B0 | 2F0 1F0 2B0 1B0"))


# -- recompute actions (R) ----------------------------------------------------------------------
def test_parse_reads_recompute_actions_and_the_grid_prints_them() -> None:
    s = parse("F0 F1 R0 B0 R1 B1 | F0 F1 R1 R0 B0 B1")
    validate(s)
    assert _strs(s.stage(1)) == ["F0", "F1", "R1", "R0", "B0", "B1"]
    assert s.rebuilds(0, 1) and not s.rebuilds(0, 2)
    assert "R1" in s.grid()
    assert repr(parse("0F0 0R0 0B0").worker(0)[1]) == "0R0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("R0 F0 B0", "runs R0 before F0"),
        ("F0 B0 R0", "runs R0 after B0; a recompute rebuilds what B reads"),
        ("F0 R0 R0 B0", "runs R0 twice"),
    ],
)
def test_validator_places_a_recompute_between_its_forward_and_backward(
    text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate(parse(text))


def test_a_rebuilt_microbatch_holds_its_graph_from_r_to_its_last_backward_action() -> None:
    # Between F and R only the stage input is held: in flight, not rebuilt.
    assert parse("F0 F1 R0 R1 B0 B1").worker_rebuilt(0) == 2
    assert parse("F0 F1 R0 B0 R1 B1").worker_rebuilt(0) == 1
    assert parse("F0 F1 R0 B0 R1 B1").worker_in_flight(0) == 2
    # A split backward holds the graph until W; a micro-batch without R is not counted.
    assert parse("F0 F1 R0 B0 R1 B1 W0 W1").worker_rebuilt(0) == 2
    assert parse("F0 F1 R0 B0 B1").worker_rebuilt(0) == 1


def test_a_recompute_waits_only_for_its_own_stage_and_costs_a_forward() -> None:
    s = parse("F0 R0 B0 | F0 R0 B0")
    # R of stage 0 runs while stage 1 still works (it needs nothing from stage 1).
    assert [[str(a) if a else "." for a in row] for row in simulate(s)] == [
        ["F0", "."],
        ["R0", "F0"],
        [".", "R0"],
        [".", "B0"],
        ["B0", "."],
    ]
    assert s.bubble() == pytest.approx(1 - 8 / 14)  # F = R = 1, B = 2: 7 time units


@pytest.mark.parametrize("name", NAMES)
def test_serial_runs_every_action_once_each_after_what_it_waits_for(name: str) -> None:
    stages = 4 if name in VIRTUAL else 2
    s = make(name, stages, 5, n_workers=2)
    order = s.serial
    assert sorted(order) == sorted(a for work in s.actions for a in work)
    at = {a: k for k, a in enumerate(order)}
    for a in order:
        s_, i = a.stage, a.microbatch
        if a.kind == "F" and s_ > 0:
            assert at[Action(s_ - 1, "F", i)] < at[a]
        if a.kind == "B":
            assert at[Action(s_, "F", i)] < at[a]
            if s_ < stages - 1:
                assert at[Action(s_ + 1, "B", i)] < at[a]
        if a.kind == "W":
            assert at[Action(s_, "B", i)] < at[a]
    for work in s.actions:  # each worker's own order kept
        assert [at[a] for a in work] == sorted(at[a] for a in work)
    assert s.serial is order  # made once
