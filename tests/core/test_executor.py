"""The one walk of an action list (pipepar.core.executor), with a carrier that logs its calls."""

from __future__ import annotations

from typing import Any

import pytest

from pipepar.core.executor import walk
from pipepar.core.schedule import Action


def _list(text: str, stage: int = 0) -> list[Action]:
    """A stage's actions, e.g. ``"F0 B0 W0"``."""
    return [Action(stage, t[0], int(t[1:])) for t in text.split()]  # type: ignore[arg-type]


class _Steps:
    """Stage steps that add their stage's number to a value, and fail where told."""

    def __init__(self, stage: int, log: list[str], fail: str = "") -> None:
        self.stage, self.log, self.fail = stage, log, fail

    def forward(self, i: int, x: Any) -> Any:
        self._run(f"F{self.stage}.{i}")
        return x + self.stage

    def backward(self, i: int, g: Any) -> Any:
        self._run(f"B{self.stage}.{i}")
        return g * 10

    def weight(self, i: int) -> None:
        self._run(f"W{self.stage}.{i}")

    def _run(self, what: str) -> None:
        if what == self.fail:
            raise ValueError(what)
        self.log.append(what)


class _Carrier:
    """Values in a dict keyed as the threads' slots are; the W in ``early`` already ran."""

    def __init__(self, log: list[str], early: tuple[tuple[int, int], ...] = ()) -> None:
        self.values: dict[tuple[str, int, int], Any] = {}
        self.log, self.early = log, early
        self.failures: list[tuple[Action, BaseException]] = []

    def begin(self, k: int, a: Action) -> None:
        self.log.append(f"begin {k}")

    def take_forward(self, k: int, a: Action) -> Any:
        return self.values.pop(("F", a.stage, a.microbatch), 100 * a.microbatch)

    def give_forward(self, k: int, a: Action, y: Any) -> None:
        self.values[("F", a.stage + 1, a.microbatch)] = y

    def take_backward(self, k: int, a: Action) -> Any:
        return self.values.pop(("B", a.stage, a.microbatch), 1)

    def give_backward(self, k: int, a: Action, g: Any) -> None:
        self.values[("B", a.stage - 1, a.microbatch)] = g

    def claim_weight(self, k: int, a: Action) -> bool:
        return (a.stage, a.microbatch) not in self.early

    def release_weight(self, k: int, a: Action) -> None:
        self.log.append(f"release {k}")

    def failed(self, a: Action, error: BaseException) -> None:
        self.failures.append((a, error))


def test_the_walk_runs_the_list_in_order_and_the_carrier_moves_the_values() -> None:
    log: list[str] = []
    carrier = _Carrier(log)
    order = [a for s in ("0F", "1F", "1B", "0B") for a in _list(f"{s[1]}0 {s[1]}1", int(s[0]))]
    walk(order, [_Steps(0, log), _Steps(1, log)], carrier)
    computed = [e for e in log if not e.startswith("begin")]
    assert computed == ["F0.0", "F0.1", "F1.0", "F1.1", "B1.0", "B1.1", "B0.0", "B0.1"]
    assert carrier.values == {
        ("F", 2, 0): 1,
        ("F", 2, 1): 101,
        ("B", -1, 0): 100,
        ("B", -1, 1): 100,
    }
    assert [e for e in log if e.startswith("begin")] == [f"begin {k}" for k in range(8)]


def test_a_w_the_carrier_ran_early_is_skipped_and_a_claimed_one_released() -> None:
    log: list[str] = []
    carrier = _Carrier(log, early=((0, 1),))
    walk(_list("F0 F1 B0 B1 W0 W1"), [_Steps(0, log)], carrier)
    computed = [e for e in log if not e.startswith("begin")]
    assert computed == ["F0.0", "F0.1", "B0.0", "B0.1", "W0.0", "release 4"]


def test_a_failure_reaches_the_carrier_then_the_caller_and_a_failed_w_is_released() -> None:
    log: list[str] = []
    carrier = _Carrier(log)
    steps = [_Steps(0, log, fail="W0.0")]
    with pytest.raises(ValueError, match=r"W0\.0"):
        walk(_list("F0 B0 W0 F1"), steps, carrier)
    assert "release 2" in log and "begin 3" not in log
    assert [(a, str(e)) for a, e in carrier.failures] == [(Action(0, "W", 0), "W0.0")]
