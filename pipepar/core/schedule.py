"""Schedules as data: which micro-batch each stage runs forward or backward, and in what order.

A schedule is a tuple of :class:`Action` per stage. ``F3`` on stage 1 means "stage 1 runs the
forward of micro-batch 3", ``B3`` its backward. Keeping the schedule as plain data lets it be
printed as a step x stage grid, checked by :func:`validate` without any process group, and
executed by either engine (threads in one process or ranks under torch.distributed).

Symbols follow the paper: ``n`` stages (K in DESIGN.md), ``m`` micro-batches (M).

    >>> s = one_f_one_b(2, 4)
    >>> [str(a) for a in s.stage(0)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']
    >>> validate(s)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "parse", "simulate", "validate"]

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs ``kind`` (F or B) on micro-batch ``microbatch``."""

    stage: int
    """Index of the stage that runs the action."""
    kind: Kind
    """``"F"`` for forward, ``"B"`` for backward."""
    microbatch: int
    """Index of the micro-batch, 0-based."""

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists for ``n_stages`` stages and ``n_microbatches`` micro-batches.

    Example:
        >>> s = gpipe(2, 2)
        >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
        step  stage0  stage1
           0  F0      .
           1  F1      F0
           2  .       F1
           3  .       B1
           4  B1      B0
           5  B0      .
    """

    name: str
    """Human-readable name, e.g. ``"gpipe"`` or ``"1f1b"``."""
    n_stages: int
    """Number of stages (K)."""
    n_microbatches: int
    """Number of micro-batches per mini-batch (M)."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[j]`` is the ordered work list of stage ``j``."""
    max_in_flight: tuple[int, ...] | None = None
    """Per-stage bound on micro-batches held between their F and B; checked by validate()."""

    def stage(self, j: int) -> tuple[Action, ...]:
        """The ordered actions of stage ``j``."""
        return self.actions[j]

    def in_flight(self, j: int) -> int:
        """Peak number of micro-batches whose forward ran on stage ``j`` but not yet backward."""
        held, peak = 0, 0
        for action in self.actions[j]:
            held += 1 if action.kind == "F" else -1
            peak = max(peak, held)
        return peak

    def grid(self) -> str:
        """The schedule as a step x stage table, each action taking one step (see simulate)."""
        steps = simulate(self)
        width = max(6, len(str(self.n_microbatches)) + 2)
        head = "step  " + "  ".join(f"stage{j}".ljust(width) for j in range(self.n_stages))
        rows = [head.rstrip()]
        for t, row in enumerate(steps):
            cells = "  ".join((str(a) if a else ".").ljust(width) for a in row)
            rows.append(f"{t:>4}  {cells}".rstrip())
        return "\n".join(rows)

    def bubble(self) -> float:
        """Idle fraction of the step x stage grid when every action takes one step."""
        steps = simulate(self)
        idle = sum(a is None for row in steps for a in row)
        return idle / (len(steps) * self.n_stages)

    def __str__(self) -> str:
        return self.grid()


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """Fill-drain schedule: every stage runs all forwards, then all backwards (last first).

    Backwards run in reverse micro-batch order, as autograd would for one big backward, so the
    last forward's activations are consumed first.

    Args:
        n_stages: number of stages K.
        n_microbatches: micro-batches per mini-batch M.

    Example:
        >>> [str(a) for a in gpipe(2, 3).stage(1)]
        ['F0', 'F1', 'F2', 'B2', 'B1', 'B0']
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    actions = tuple(
        tuple(Action(j, "F", i) for i in range(m))
        + tuple(Action(j, "B", i) for i in reversed(range(m)))
        for j in range(n)
    )
    return Schedule("gpipe", n, m, actions, max_in_flight=(m,) * n)


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B: a warm-up of ``K-1-j`` forwards on stage ``j``, then alternate one F and one B.

    Stage ``j`` holds at most ``min(K - j, M)`` micro-batches of activations at once.

    Args:
        n_stages: number of stages K.
        n_microbatches: micro-batches per mini-batch M.

    Example:
        >>> [str(a) for a in one_f_one_b(3, 4).stage(0)]
        ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    per_stage = []
    for j in range(n):
        warmup = min(n - 1 - j, m)
        work = [Action(j, "F", i) for i in range(warmup)]  # warm-up
        for i in range(m - warmup):  # steady state: one forward, one backward
            work += [Action(j, "F", warmup + i), Action(j, "B", i)]
        work += [Action(j, "B", i) for i in range(m - warmup, m)]  # cool-down
        per_stage.append(tuple(work))
    bound = tuple(min(n - j, m) for j in range(n))
    return Schedule("1f1b", n, m, tuple(per_stage), max_in_flight=bound)


def parse(text: str | Sequence[str], *, name: str = "custom") -> Schedule:
    """Build a schedule from per-stage strings such as ``["F0 F1 B0 B1", "F0 B0 F1 B1"]``.

    Args:
        text: one string per stage (a sequence), or one string with stages separated by ``|``.
        name: name given to the schedule.

    Example:
        >>> s = parse("F0 F1 B1 B0 | F0 F1 B1 B0")
        >>> s.n_stages, s.n_microbatches
        (2, 2)
    """
    lines = text.split("|") if isinstance(text, str) else list(text)
    actions = tuple(
        tuple(_parse_action(j, tok) for tok in line.split()) for j, line in enumerate(lines)
    )
    m = 1 + max((a.microbatch for stage in actions for a in stage), default=-1)
    return Schedule(name, len(actions), m, actions)


def simulate(schedule: Schedule) -> list[list[Action | None]]:
    """Run the schedule on a unit-time clock and return, per step, what each stage runs.

    At each step every stage runs its next action if the actions it depends on finished in an
    earlier step (F on the previous stage, B on the next stage); otherwise it idles.

    Raises:
        ValueError: if no stage can progress while work remains (the schedule deadlocks).

    Example:
        >>> [[str(a) if a else "." for a in row] for row in simulate(gpipe(1, 2))]
        [['F0'], ['F1'], ['B1'], ['B0']]
    """
    n = schedule.n_stages
    done: set[tuple[int, Kind, int]] = set()
    cursor = [0] * n
    steps: list[list[Action | None]] = []
    while any(cursor[j] < len(schedule.actions[j]) for j in range(n)):
        row = [_runnable(schedule, j, cursor[j], done) for j in range(n)]
        if not any(row):
            stuck = [
                repr(schedule.actions[j][cursor[j]])
                for j in range(n)
                if row[j] is None and cursor[j] < len(schedule.actions[j])
            ]
            raise ValueError(
                f"schedule {schedule.name!r} deadlocks at step {len(steps)}: {', '.join(stuck)} "
                "wait on each other; order each stage's forwards like the previous stage's and "
                "its backwards like the next stage's"
            )
        for j, action in enumerate(row):
            if action is not None:
                cursor[j] += 1
                done.add((action.stage, action.kind, action.microbatch))
        steps.append(row)
    return steps


def validate(schedule: Schedule) -> None:
    """Check that a schedule is complete, consistent, runnable and within its memory bound.

    Checks: every stage runs ``F(i)`` and ``B(i)`` exactly once for each micro-batch ``i``;
    ``B(i)`` follows ``F(i)`` on a stage; ``F(i)`` on stage ``j`` can follow ``F(i)`` on
    ``j-1`` and ``B(i)`` on ``j`` can follow ``B(i)`` on ``j+1`` without deadlock; and no stage
    holds more than ``max_in_flight[j]`` micro-batches at once.

    Raises:
        ValueError: naming the first violation and how to fix it.

    Example:
        >>> validate(one_f_one_b(4, 8))
    """
    if len(schedule.actions) != schedule.n_stages:
        raise ValueError(
            f"schedule has {len(schedule.actions)} action lists but n_stages="
            f"{schedule.n_stages}; give one list per stage"
        )
    for j, work in enumerate(schedule.actions):
        _check_stage(schedule, j, work)
    simulate(schedule)


def _check_stage(schedule: Schedule, j: int, work: Iterable[Action]) -> None:
    seen: set[tuple[str, int]] = set()
    m = schedule.n_microbatches
    for action in work:
        key = (action.kind, action.microbatch)
        if action.stage != j:
            raise ValueError(f"stage {j} lists {action!r}, which belongs to stage {action.stage}")
        if action.kind not in ("F", "B") or not 0 <= action.microbatch < m:
            raise ValueError(
                f"stage {j} lists {action!r}; kinds are F/B and micro-batches 0..{m - 1}"
            )
        if key in seen:
            raise ValueError(f"stage {j} runs {action} twice; each action must appear once")
        if action.kind == "B" and ("F", action.microbatch) not in seen:
            raise ValueError(f"stage {j} runs {action} before F{action.microbatch}; move it later")
        seen.add(key)
    missing = [f"{k}{i}" for k in ("F", "B") for i in range(m) if (k, i) not in seen]
    if missing:
        raise ValueError(f"stage {j} never runs {', '.join(missing)}; add them to its list")
    bound = schedule.max_in_flight
    if bound is not None and schedule.in_flight(j) > bound[j]:
        raise ValueError(
            f"stage {j} holds {schedule.in_flight(j)} micro-batches at once but the schedule "
            f"allows {bound[j]}; run a backward sooner"
        )


def _runnable(
    schedule: Schedule, j: int, k: int, done: set[tuple[int, Kind, int]]
) -> Action | None:
    """The action at position ``k`` of stage ``j`` if its cross-stage dependency is met."""
    if k >= len(schedule.actions[j]):
        return None
    a = schedule.actions[j][k]
    if a.kind == "F":
        ready = j == 0 or (j - 1, "F", a.microbatch) in done
    else:
        ready = j == schedule.n_stages - 1 or (j + 1, "B", a.microbatch) in done
    return a if ready else None


def _parse_action(j: int, token: str) -> Action:
    kind, digits = token[:1].upper(), token[1:]
    if kind not in ("F", "B") or not digits.isdigit():
        raise ValueError(f"cannot read action {token!r} on stage {j}; write e.g. 'F0' or 'B3'")
    return Action(j, "F" if kind == "F" else "B", int(digits))


def _check_sizes(n_stages: int, n_microbatches: int) -> tuple[int, int]:
    for label, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}; pass e.g. 4")
        if value < 1:
            raise ValueError(f"{label} must be at least 1, got {value}; pass e.g. 4")
    return n_stages, n_microbatches
