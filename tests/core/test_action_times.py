"""Stage times measured over a training mini-batch, settled once, as placement costs."""

from __future__ import annotations

import pytest

from pipepar.core.action_times import ActionTimes
from pipepar.core.schedule import Action


def test_costs_are_each_stages_mean_per_kind_once_every_stage_ran_f_and_b() -> None:
    times = ActionTimes(2)
    times.record(0, 0, "forward", 0.0, 1.0)
    times.record(0, 1, "forward", 1.0, 4.0)  # mean 2
    times.record(0, 0, "backward", 4.0, 8.0)
    times.record(1, 0, "forward", 0.0, 0.5)
    times.record(1, 0, "wait", 0.5, 9.0)  # not a computation: not counted
    assert not times.settled  # stage 1 has no backward yet
    with pytest.raises(ValueError, match="run a training step"):
        times.cost()
    times.record(1, 0, "recompute", 1.0, 1.25)
    times.record(1, 0, "backward", 1.0, 2.0)
    cost = times.cost()
    assert times.settled
    assert cost(Action(0, "F", 0), False) == 2.0
    assert cost(Action(0, "R", 0), False) == 2.0  # never measured: the forward's
    assert cost(Action(1, "R", 0), False) == 0.25
    assert cost(Action(0, "B", 0), False) == 4.0
    assert cost(Action(1, "W", 0), True) == 0.5  # never measured: the forward's
    times.record(0, 2, "forward", 0.0, 100.0)  # settled: later steps change nothing
    assert times.cost()(Action(0, "F", 0), False) == 2.0
