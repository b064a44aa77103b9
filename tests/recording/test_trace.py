"""Recording a pipe's actions (Tracer, tracing) and the figures a Timeline derives from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipepar
from pipepar.core.named_schedules import gpipe, one_f_one_b
from pipepar.core.schedule import simulate
from pipepar.recording.tracer import KINDS, Event, Timeline, Tracer, tracing


def _pipe(*, trace: bool = False, chunks: int = 2) -> pipepar.Pipe:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    return pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=chunks, trace=trace)


def _unit_events(
    schedule_k: int, schedule_m: int, *, one_f_one_b_order: bool = False
) -> list[Event]:
    """Events of a schedule where every action takes one second (from schedule.simulate)."""
    make = one_f_one_b if one_f_one_b_order else gpipe
    events = []
    for t, row in enumerate(simulate(make(schedule_k, schedule_m))):
        for action in row:
            if action is not None:
                kind = "forward" if action.kind == "F" else "backward"
                events.append(Event(action.stage, action.microbatch, kind, 100.0 + t, 101.0 + t))
    return events


# -- recording ---------------------------------------------------------------------------------
def test_tracer_is_off_by_default_and_records_when_on() -> None:
    off, on = _pipe(), _pipe(trace=True)
    x = torch.randn(4, 8)
    off(x).sum().backward()
    on(x).sum().backward()
    assert off.tracer is None
    assert on.tracer is not None
    kinds = {e.kind for e in on.tracer.events}
    assert {"wait", "forward", "backward"} <= kinds


def test_tracing_turns_recording_on_for_the_block_only() -> None:
    pipe = _pipe()
    x = torch.randn(4, 8)
    with tracing(pipe) as tracer:
        assert pipe.tracer is tracer
        pipe(x).sum().backward()
    assert pipe.tracer is None
    n = len(tracer.events)
    pipe(x).sum().backward()  # after the block: nothing more is recorded
    assert len(tracer.events) == n > 0


def test_tracing_restores_the_previous_tracer_even_on_error() -> None:
    pipe = _pipe(trace=True)
    before = pipe.tracer
    with pytest.raises(RuntimeError, match="boom"), tracing(pipe) as tracer:
        assert tracer is not before
        raise RuntimeError("boom")
    assert pipe.tracer is before


def test_backward_after_the_block_is_still_recorded() -> None:
    pipe = _pipe()
    with tracing(pipe) as tracer:
        out = pipe(torch.randn(4, 8))
    out.sum().backward()
    assert sum(e.kind == "backward" for e in tracer.events) == 2 * pipe.chunks


def test_tracing_rejects_what_is_not_a_pipe() -> None:
    with pytest.raises(TypeError, match=r"pipepar\.wrap"), tracing(nn.Linear(2, 2)):
        pass


def test_clear_forgets_events_and_restarts_the_clock() -> None:
    tracer = Tracer()
    origin = tracer.origin
    tracer.record(0, 0, "forward", origin + 1, origin + 2)
    tracer.clear()
    assert tracer.events == []
    assert tracer.origin >= origin


# -- figures -----------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 5), m=st.integers(1, 9))
def test_unit_time_gpipe_has_the_textbook_bubble(k: int, m: int) -> None:
    timeline = Timeline(_unit_events(k, m))
    assert timeline.n_stages == k and timeline.n_microbatches == m
    assert timeline.span == pytest.approx(2 * (m + k - 1))
    assert timeline.bubble == pytest.approx((k - 1) / (m + k - 1))
    assert timeline.ideal_bubble == pytest.approx((k - 1) / (m + k - 1))
    assert timeline.schedule().actions == gpipe(k, m).actions


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), m=st.integers(1, 8))
def test_observed_schedule_tells_1f1b_from_gpipe(k: int, m: int) -> None:
    observed = Timeline(_unit_events(k, m, one_f_one_b_order=True)).schedule()
    assert observed.actions == one_f_one_b(k, m).actions
    if k > 1 and m > 1:
        assert observed.actions != gpipe(k, m).actions


def test_times_are_relative_to_the_first_event() -> None:
    timeline = Timeline(_unit_events(2, 2))
    assert timeline.origin == 100.0
    assert timeline.events[0].start == 0.0
    assert timeline.end == pytest.approx(timeline.span)


def test_recompute_inside_backward_is_not_counted_twice() -> None:
    events = [
        Event(0, 0, "forward", 0.0, 1.0),
        Event(0, 0, "wait", 1.0, 2.0),
        Event(0, 0, "backward", 2.0, 5.0),
        Event(0, 0, "recompute", 2.0, 3.0),
    ]
    timeline = Timeline(events)
    assert timeline.busy(0) == pytest.approx(4.0)
    assert timeline.seconds(0, "recompute") == pytest.approx(1.0)
    assert timeline.bubble == pytest.approx(1 - 4.0 / 5.0)


def test_seconds_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="kind='idle'"):
        Timeline([]).seconds(0, "idle")


def test_empty_timeline() -> None:
    timeline = Tracer().timeline()
    assert (len(timeline), timeline.span, timeline.bubble, timeline.steps()) == (0, 0.0, 0.0, [])


def test_steps_split_mini_batches_and_keep_waits_with_their_action() -> None:
    first = _unit_events(2, 3)
    shift = 50.0
    second = [Event(e.stage, e.microbatch, e.kind, e.start + shift, e.end + shift) for e in first]
    # stage 0 waits for micro-batch 0's input of the second mini-batch just before its forward
    wait = Event(0, 0, "wait", second[0].start - 0.5, second[0].start)
    timeline = Timeline(first + [wait] + second)
    steps = timeline.steps()
    assert [len(s) for s in steps] == [len(first), len(second) + 1]
    assert steps[1].events[0].kind == "wait"
    assert steps[1].origin == pytest.approx(wait.start)
    for step in steps:
        assert step.schedule().actions == gpipe(2, 3).actions
        assert step.bubble == pytest.approx(1 / 4, abs=0.05)
    with pytest.raises(ValueError, match="steps"):
        timeline.schedule()


def test_summary_names_every_stage() -> None:
    text = Timeline(_unit_events(3, 4)).summary()
    assert "3 stages x 4 micro-batches" in text
    assert all(f"\n{j:>5} " in text for j in range(3))


def test_event_labels() -> None:
    labels = [Event(1, 3, kind, 0.0, 1.0).label for kind in KINDS]
    assert labels == ["w3", "T3", "F3", "B3", "W3", "R3"]


def test_by_worker_puts_virtual_stages_on_their_device_lane() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    pipe = pipepar.wrap(model, [1, 1, 1, 1], devices=["cpu", "cpu"], chunks=2, schedule="zb-v")
    with tracing(pipe) as tracer:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    per_stage = tracer.timeline()
    per_worker = per_stage.by_worker(pipe.schedule.placement)
    assert per_stage.n_stages == 4 and per_worker.n_stages == 2
    assert len(per_worker) == len(per_stage)
    # worker 0 holds stages 0 and 3, and may have run a W of stage 1 or 2 while idle
    mine = [e for s in (0, 3) for e in per_stage.of_stage(s) if e.worker in (None, 0)]
    taken = [e for s in (1, 2) for e in per_stage.of_stage(s) if e.worker == 0]
    assert all(e.kind == "weight" for e in taken)
    assert sorted(e.label for e in per_worker.of_stage(0)) == sorted(
        e.label for e in mine + taken
    )
