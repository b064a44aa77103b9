"""Python's cycle collector around a pipe's steps (``gc_every``): off while a step runs, the
young generations collected after each step, a full collection every N steps; back as it was
after the step, even one that failed; bad values refused with the fix."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pipepar.core.garbage import StepCollector


@pytest.fixture
def passes() -> Iterator[list[int]]:
    """The generation of every collection that ends while the test runs."""
    found: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            found.append(info["generation"])

    was_on = gc.isenabled()
    gc.disable()  # no automatic pass between the steps: only the collector's own
    gc.callbacks.append(record)
    try:
        yield found
    finally:
        gc.callbacks.remove(record)
        if was_on:
            gc.enable()


def test_off_during_a_step_and_a_full_pass_every_n_steps(passes: list[int]) -> None:
    gc.enable()
    collector = StepCollector(3)
    during = []
    for _ in range(6):
        with collector.step():
            during.append(gc.isenabled())
            gc.collect(0)  # what the step's own code may ask for still runs
        assert gc.isenabled()
    assert during == [False] * 6
    own = [g for k, g in enumerate(passes) if k % 2 == 1]  # after each step's own gen-0 pass
    assert own == [1, 1, 2, 1, 1, 2] and collector.steps == 6


def test_none_leaves_the_collector_alone(passes: list[int]) -> None:
    gc.enable()
    collector = StepCollector(None)
    with collector.step():
        assert gc.isenabled()
    assert passes == [] and collector.steps == 0


def test_a_collector_off_before_stays_off(passes: list[int]) -> None:
    collector = StepCollector(1)
    with collector.step():
        pass
    assert not gc.isenabled() and passes == [2]


def test_a_failing_step_turns_it_back_on(passes: list[int]) -> None:
    gc.enable()
    collector = StepCollector(2)
    with pytest.raises(RuntimeError, match="layer failed"), collector.step():
        raise RuntimeError("layer failed")
    assert gc.isenabled() and passes == [1] and collector.steps == 1


def test_overlapping_steps_turn_it_on_after_the_last(passes: list[int]) -> None:
    gc.enable()
    first, second = StepCollector(5), StepCollector(5)
    with first.step():
        with second.step():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the first pipe's step still runs
    assert gc.isenabled()


@pytest.mark.parametrize("bad", ["100", 1.5, True])
def test_gc_every_of_another_type_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"gc_every must be None or an int.*gc_every=100"):
        StepCollector(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3])
def test_gc_every_below_one_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"gc_every must be at least 1, but got {bad}"):
        StepCollector(bad)
