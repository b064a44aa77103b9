"""V-Half and V-Min: building blocks repeated without collisions, their memory bound against
1F1B's, and list scheduling that reserves a V's way back (no process group)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipepar.core.named_schedules import make, one_f_one_b, v_half, v_min, zb_v
from pipepar.core.schedule import Action, Schedule, timed, validate
from pipepar.core.schedule_blocks import INTERVAL, STYLES, held, repeated, v_block
from pipepar.core.schedule_greedy import greedy_orders


def _peak(s: Schedule) -> int:
    return max(s.worker_in_flight(w) for w in range(s.n_workers))


def _cost(a: Action, split: bool) -> float:
    """F = 1, B = 1, W = 0.75 per half stage; the first stage's B free, its W whole (as
    named_schedules times its candidates); 1F1B's full stages cost twice a half one."""
    if a.kind == "F":
        return 1.0
    if a.stage == 0 and split:
        return 0.0 if a.kind == "B" else 1.75
    return 1.0 if a.kind == "B" and split else 0.75 if a.kind == "W" else 1.75


def _span(s: Schedule, scale: float = 1.0) -> float:
    return max(timed(s, lambda a, split: scale * _cost(a, split)).values())


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("style", STYLES)
def test_a_block_puts_each_workers_six_passes_on_six_residues(k: int, style: str) -> None:
    block = v_block(k, style)
    for w in range(k):
        mine = [t for (s, _), t in block.items() if s in (w, 2 * k - 1 - w)]
        assert sorted(t % INTERVAL for t in mine) == list(range(INTERVAL))
    for s in range(2 * k):  # every pass after what it waits for
        assert block[(s, "B")] < block[(s, "W")]
        if s:
            assert block[(s - 1, "F")] < block[(s, "F")]
        if s < 2 * k - 1:
            assert block[(s + 1, "B")] < block[(s, "B")]


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_repeating_a_block_holds_what_the_block_says(k: int) -> None:
    for style in STYLES:
        block = v_block(k, style)
        orders = repeated(block, k, 4 * k)
        placement = tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))
        actions = tuple(tuple(Action(s, kind, i) for s, kind, i in o) for o in orders)  # type: ignore[arg-type]
        s = Schedule("block", 2 * k, 4 * k, actions, placement)
        validate(s)
        assert _peak(s) == held(block, k)


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
def test_v_min_and_v_half_hold_less_than_1f1b_and_say_so(k: int) -> None:
    m = 4 * k
    ref = 2 * one_f_one_b(k, m).in_flight(0)  # full stages: two halves each
    lo, mid = v_min(2 * k, m), v_half(2 * k, m)
    for s in (lo, mid):
        validate(s)
        assert s.stages_of(0) == [0, 2 * k - 1]
        assert all(s.splits_backward(st_, i) for st_ in range(2 * k) for i in range(m))
    assert _peak(lo) <= lo.max_in_flight[0] == 2 * ((k + 4) // 3) - (k == 2)  # type: ignore[index]
    assert _peak(mid) <= mid.max_in_flight[0] == k + 2  # type: ignore[index]
    assert _peak(lo) < _peak(mid) <= ref == _peak(zb_v(2 * k, m))
    assert _peak(mid) < ref or k == 2  # on 2 workers V-Half holds what 1F1B does
    assert 2 * _peak(lo) <= ref or k < 4  # half from 4 workers on (3 of 4, 4 of 6 below)


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_v_schedules_run_about_as_fast_as_1f1b(k: int, m: int) -> None:
    base = _span(one_f_one_b(k, m), scale=2.0)  # a full stage is two half stages
    for s in (v_min(2 * k, m), v_half(2 * k, m)):
        assert _span(s) <= 1.03 * base


@settings(max_examples=20, deadline=None)
@given(st.tuples(st.integers(1, 5), st.integers(1, 12)))
def test_v_schedules_build_for_any_size_and_by_name(size: tuple[int, int]) -> None:
    k, m = size
    for name in ("v-half", "v-min"):
        s = make(name, 2 * k, m, n_workers=k)
        validate(s)
        assert s.name == name and s.n_workers == k


def test_v_schedules_need_two_stages_per_worker() -> None:
    with pytest.raises(ValueError, match="v-min runs a V of 2 stages per worker"):
        v_min(3, 4)
    with pytest.raises(ValueError, match="pass balance with 4 entries"):
        make("v-half", 2, 4, n_workers=2)


def test_reserving_the_way_back_keeps_a_tight_v_from_deadlocking() -> None:
    placement = (0, 1, 1, 0)
    with pytest.raises(ValueError, match="cannot progress"):
        greedy_orders(placement, 2, 4, (2, 2), split=True)
    first, _ = greedy_orders(placement, 2, 4, (2, 2), split=True, reserve=True)
    assert first[:2] == [(0, "F", 0), (3, "F", 0)]
