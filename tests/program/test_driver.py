"""Driver: a micro-batch's forward on its own thread, run stage by stage when advanced; prepare
lets it run on through the stages before a given one without waiting; the rank's walk
prepares each micro-batch's way to its first stage at the backward before it."""

from __future__ import annotations

import contextlib
import threading
import time

from pipepar.core.named_schedules import make
from pipepar.program.driver import Driver, active
from pipepar.program.rank_compute import _ahead


def _three_stages(ran: list[int]) -> tuple[Driver, threading.Thread]:
    """A driver whose call computes stages 0, 1 and 2, noting each as it starts it, started
    on its thread."""

    def call() -> str:
        for stage in range(3):
            driver = active()
            assert driver is not None
            driver.boundary(stage)
            ran.append(stage)
        return "out"

    driver = Driver(call, lambda stage: contextlib.nullcontext())
    thread = threading.Thread(target=driver.run)
    thread.start()
    return driver, thread


def _wait_for(condition: object, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.001)


def test_prepare_runs_the_stages_before_one_without_waiting_then_advance_goes_on() -> None:
    ran: list[int] = []
    driver, thread = _three_stages(ran)
    driver.prepare(2)  # returns at once; stages 0 and 1 run on the driver's thread
    _wait_for(lambda: ran == [0, 1])
    time.sleep(0.05)
    assert ran == [0, 1]  # stopped before stage 2
    driver.advance(2)
    thread.join(5)
    assert ran == [0, 1, 2] and driver.result == "out"


def test_advance_while_a_prepared_driver_still_runs_takes_it_through() -> None:
    ran: list[int] = []
    driver, thread = _three_stages(ran)
    driver.prepare(1)
    driver.advance(2)  # perhaps before stage 0 finished: the driver runs on to the end
    thread.join(5)
    assert ran == [0, 1, 2] and driver.result == "out"


def test_prepare_after_the_driver_got_there_does_nothing() -> None:
    ran: list[int] = []
    driver, thread = _three_stages(ran)
    driver.advance(1)
    assert ran == [0, 1]
    driver.prepare(2)
    driver.prepare(1)
    time.sleep(0.05)
    assert ran == [0, 1]
    driver.advance(2)
    thread.join(5)
    assert ran == [0, 1, 2]


def test_the_walk_prepares_each_forward_at_the_backward_before_it() -> None:
    last = make("1f1b", 2, 4, n_workers=2).worker(1)  # F0 B0 F1 B1 F2 B2 F3 B3
    assert [(a.stage, str(a)) for a in last][:3] == [(1, "F0"), (1, "B0"), (1, "F1")]
    assert _ahead(last, 1) == {1: 1, 3: 2, 5: 3}
    assert _ahead(make("gpipe", 2, 4, n_workers=2).worker(1), 1) == {}  # no backward between
    assert _ahead(make("1f1b", 2, 4, n_workers=2).worker(0), 0) == {}  # the first stage's rank
