"""Schedules as data: which stage runs which action on which micro-batch, on which worker, when.

A *worker* is what runs actions one after another: a thread bound to a device in one process, or
a rank under torch.distributed. A schedule gives each worker an ordered list of :class:`Action`.
``1F3`` means "stage 1 runs the forward of micro-batch 3"; ``1B3`` its backward and ``1W3`` its
weight gradients. A stage whose list has no ``W`` for a micro-batch runs the whole backward in
``B``; with a ``W``, ``B`` computes only the gradient of the stage input (what the previous stage
waits for) and ``W`` the parameter gradients later, in time the stage would otherwise idle
(zero-bubble schedules, Qi et al. 2024). ``1R3`` rebuilds micro-batch 3's activations on
stage 1 (a recompute listed on its own, placed in time the worker would idle before ``1B3``):
the forward ``F`` of that micro-batch keeps only the stage input, ``R`` runs the stage again and
keeps its graph for ``B`` (:mod:`pipepar.core.recompute_placement` places them).

With *virtual stages* a worker holds several stages: looped (stage ``s`` on worker ``s % K``,
interleaved 1F1B) or V-shaped (worker ``w`` holds stages ``w`` and ``2K-1-w``, ZB-V).

Keeping schedules as data lets one definition drive every runtime: it prints as a step x worker
grid, is checked by :func:`validate` without any process group, predicts its bubble and its
memory (micro-batches in flight), and is executed unchanged by threads or by ranks. The named
schedules are built in :mod:`pipepar.core.named_schedules`.

Symbols: ``K`` workers, ``M`` micro-batches, ``V`` stages per worker.

    >>> from pipepar.core.named_schedules import gpipe, one_f_one_b, zb_v
    >>> s = one_f_one_b(2, 4)
    >>> [str(a) for a in s.stage(0)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']
    >>> validate(s)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Action", "Schedule", "parse", "simulate", "timed", "unit_costs", "validate"]

Kind = Literal["F", "R", "B", "W"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs ``kind`` on micro-batch ``microbatch``."""

    stage: int
    """Index of the (virtual) stage that runs the action."""
    kind: Kind
    """``"F"`` forward, ``"R"`` recompute (rebuild the forward's graph from the kept input),
    ``"B"`` backward (input gradient; everything if no W follows), ``"W"`` parameter
    gradients."""
    microbatch: int
    """Index of the micro-batch, 0-based."""

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


_Waiting = tuple[Action, tuple["Action | None", ...], bool]
"""An action, the actions of other stages it waits for, whether its stage splits its backward."""


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for ``n_stages`` stages and ``n_microbatches`` micro-batches.

    A schedule is data: ``actions[w]`` is worker ``w``'s ordered list of :class:`Action`
    (``F``: forward of a stage on a micro-batch; ``R``: its recompute, ahead of ``B``, for a
    checkpointed micro-batch; ``B``: its backward, or only the input gradient when the
    schedule also lists a ``W``; ``W``: the deferred weight gradient).
    The named schedules are built by :func:`gpipe`, :func:`one_f_one_b`, :func:`zb_h1`,
    :func:`interleaved_1f1b` and :func:`zb_v` (:func:`make` by name), your own by
    :func:`parse`; :func:`validate` checks that every dependency can be met without a
    deadlock. Pass a name or a Schedule as ``schedule=`` to :func:`pipepar.wrap` and
    :func:`pipepar.distributed.wrap`; ``print(pipe.schedule)`` shows the grid.

    Args:
        name: a human-readable name, e.g. ``"gpipe"``.
        n_stages: the number of (virtual) stages.
        n_microbatches: micro-batches per mini-batch (M).
        actions: per worker, its ordered actions.
        placement: ``placement[s]`` is the worker of stage ``s`` (default: stage ``s`` on
            worker ``s``).
        max_in_flight: per worker, a bound on the micro-batches it holds, checked by
            :func:`validate`; None for no bound.

    Example:
        >>> s = gpipe(2, 2)
        >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
        step  worker0  worker1
           0  F0       .
           1  F1       F0
           2  .        F1
           3  .        B1
           4  B1       B0
           5  B0       .
        >>> custom = parse("F0 F1 B0 B1 | F0 B0 F1 B1")  # one line per worker, "|" between
        >>> custom.n_workers, custom.bubble() > 0
        (2, True)
    """

    name: str
    """Human-readable name, e.g. ``"gpipe"`` or ``"zb-v"``."""
    n_stages: int
    """Number of (virtual) stages."""
    n_microbatches: int
    """Number of micro-batches per mini-batch (M)."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[w]`` is the ordered work list of worker ``w``."""
    placement: tuple[int, ...] = ()
    """``placement[s]`` is the worker of stage ``s``; empty means stage ``s`` on worker ``s``."""
    max_in_flight: tuple[int, ...] | None = None
    """Per-worker bound on stage micro-batches held between F and their last backward action;
    checked by :func:`validate`."""
    _split: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)
    _rebuilt: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", tuple(range(self.n_stages)))
        split = {(a.stage, a.microbatch) for work in self.actions for a in work if a.kind == "W"}
        object.__setattr__(self, "_split", frozenset(split))
        rebuilt = {(a.stage, a.microbatch) for work in self.actions for a in work if a.kind == "R"}
        object.__setattr__(self, "_rebuilt", frozenset(rebuilt))

    @property
    def n_workers(self) -> int:
        """Number of workers (devices or ranks) K."""
        return len(self.actions)

    @property
    def virtual(self) -> int:
        """Stages per worker V (1 for GPipe, 1F1B and ZB-H1)."""
        return self.n_stages // max(1, self.n_workers)

    @functools.cached_property
    def serial(self) -> tuple[Action, ...]:
        """Every worker's actions in one order that never waits for an input: :func:`simulate`'s
        steps one after another (what one thread runs for all the workers), made once.

        Example:
            >>> parse("F0 B0 | F0 B0").serial  # stage 0 on worker 0, stage 1 on worker 1
            (0F0, 1F0, 1B0, 0B0)
        """
        return tuple(a for row in simulate(self) for a in row if a is not None)

    @functools.cached_property
    def waits(self) -> tuple[tuple[_Waiting, ...], ...]:
        """Per worker, each action in list order with the actions of other stages it waits
        for (None: one the schedule lacks, so it never runs) and whether its stage splits its
        backward: what :func:`timed` reads, found once per schedule.

        Example:
            >>> parse("F0 B0 | F0 B0").waits[1][0]
            (1F0, (0F0,), False)
        """
        key: dict[tuple[int, str, int], Action] = {
            (a.stage, a.kind, a.microbatch): a for work in self.actions for a in work
        }
        return tuple(
            tuple(
                (
                    a,
                    tuple(key.get(d) for d in _deps(a, self)),
                    (a.stage, a.microbatch) in self._split,
                )
                for a in work
            )
            for work in self.actions
        )

    def worker(self, w: int) -> tuple[Action, ...]:
        """The ordered actions of worker ``w``."""
        return self.actions[w]

    def stages_of(self, w: int) -> list[int]:
        """The stages worker ``w`` runs, in stage order."""
        return [s for s, owner in enumerate(self.placement) if owner == w]

    def stage(self, s: int) -> tuple[Action, ...]:
        """The ordered actions of stage ``s`` (a sub-sequence of its worker's list)."""
        return tuple(a for a in self.actions[self.placement[s]] if a.stage == s)

    def splits_backward(self, s: int, i: int) -> bool:
        """True if stage ``s`` runs micro-batch ``i``'s parameter gradients in a separate W."""
        return (s, i) in self._split

    def in_order(self) -> bool:
        """Whether every stage runs its forwards, and its backwards, in micro-batch order (so
        the gradients of a pair of stages come back in the order their values were sent)."""
        for s in range(self.n_stages):
            actions = self.stage(s)
            for kind in ("F", "B", "W"):
                order = [a.microbatch for a in actions if a.kind == kind]
                if order != sorted(order):
                    return False
        return True

    def in_flight(self, s: int) -> int:
        """Peak number of micro-batches stage ``s`` holds: forward run, last backward not yet."""
        return int(_peak_held(self.stage(s), self))

    def worker_in_flight(self, w: int) -> int:
        """Peak number of stage micro-batches worker ``w`` holds at once, over its stages."""
        return int(_peak_held(self.actions[w], self))

    def worker_held(self, w: int, weight: Sequence[float]) -> float:
        """Peak of what worker ``w`` holds when a micro-batch of stage ``s`` weighs
        ``weight[s]`` (e.g. its activation bytes) from its F to its last backward action.

        Example:
            >>> zb_v(4, 8).worker_held(0, [0.5] * 4)  # half stages: 1F1B's first stage's 2
            2.0
        """
        return _peak_held(self.actions[w], self, weight)

    def worker_rebuilt(self, w: int) -> int:
        """Peak number of stage micro-batches worker ``w`` holds rebuilt at once: their ``R``
        has run and their last backward action not yet (before ``R`` such a micro-batch
        holds only its stage input).

        Example:
            >>> parse("F0 F1 R0 R1 B0 B1").worker_rebuilt(0)
            2
            >>> parse("F0 F1 R0 B0 R1 B1").worker_rebuilt(0)
            1
        """
        return int(_peak_held(self.actions[w], self, start="R"))

    def rebuilds(self, s: int, i: int) -> bool:
        """True if stage ``s`` rebuilds micro-batch ``i`` in a listed ``R``."""
        return (s, i) in self._rebuilt

    def grid(self) -> str:
        """The schedule as a step x worker table, each action taking one step (see simulate)."""
        steps = simulate(self)
        show = repr if self.virtual > 1 else str
        width = max(7, len(str(self.n_microbatches)) + 3)
        head = "step  " + "  ".join(f"worker{w}".ljust(width) for w in range(self.n_workers))
        rows = [head.rstrip()]
        for t, row in enumerate(steps):
            cells = "  ".join((show(a) if a else ".").ljust(width) for a in row)
            rows.append(f"{t:>4}  {cells}".rstrip())
        return "\n".join(rows)

    def bubble(self, costs: Callable[[Action, bool], float] | None = None) -> float:
        """Idle fraction of the workers' time when actions take ``costs(action, split)``.

        The default costs are F = 1, B = W = 1 and a whole backward = 2, each divided by the
        stages per worker (a virtual stage holds 1/V of a worker's layers).

        Example:
            >>> round(one_f_one_b(2, 8).bubble(), 3)  # (K-1)/(M+K-1)
            0.111
        """
        cost = costs or unit_costs(self.virtual)
        finish = timed(self, cost)
        span = max(finish.values(), default=0.0)
        busy = sum(cost(a, self.splits_backward(a.stage, a.microbatch)) for a in finish)
        return 1.0 - busy / (span * self.n_workers) if span else 0.0

    def __str__(self) -> str:
        return self.grid()


# -- reading and checking ----------------------------------------------------------------------
def parse(text: str | Sequence[str], *, name: str = "custom") -> Schedule:
    """Build a schedule from per-worker strings such as ``["F0 F1 B0 B1", "F0 B0 F1 B1"]``.

    An action is ``F3``, ``R3``, ``B3`` or ``W3`` (stage = the worker) or ``2F3`` (stage 2).

    Args:
        text: one string per worker (a sequence), or one string with workers separated by ``|``.
        name: name given to the schedule.

    Example:
        >>> s = parse("F0 F1 B1 B0 | F0 F1 B1 B0")
        >>> s.n_stages, s.n_microbatches
        (2, 2)
        >>> parse("0F0 3F0 3B0 0B0 | 1F0 2F0 2B0 1B0").stages_of(0)
        [0, 3]
    """
    lines = text.split("|") if isinstance(text, str) else list(text)
    actions = tuple(
        tuple(_parse_action(w, tok) for tok in line.split()) for w, line in enumerate(lines)
    )
    owners: dict[int, int] = {}
    for w, work in enumerate(actions):
        for a in work:
            if owners.setdefault(a.stage, w) != w:
                raise ValueError(
                    f"stage {a.stage} appears on workers {owners[a.stage]} and {w}; "
                    "a stage runs on one worker"
                )
    n = 1 + max(owners, default=-1)
    missing = [s for s in range(n) if s not in owners]
    if missing:
        raise ValueError(f"no worker runs stage(s) {missing}; give each stage its actions")
    m = 1 + max((a.microbatch for work in actions for a in work), default=-1)
    return Schedule(name, n, m, actions, tuple(owners[s] for s in range(n)))


def _deps(action: Action, schedule: Schedule) -> tuple[tuple[int, str, int], ...]:
    """The actions of other stages that ``action`` waits for (same-stage order is the list's)."""
    s, i, last = action.stage, action.microbatch, schedule.n_stages - 1
    if action.kind == "F":
        return ((s - 1, "F", i),) if s > 0 else ()
    if action.kind == "B":
        return ((s + 1, "B", i),) if s < last else ((s, "F", i),)
    if action.kind == "R":  # its own stage's F: the list's order
        return ()
    return ((s, "B", i),)


def simulate(schedule: Schedule) -> list[list[Action | None]]:
    """Run the schedule on a unit-time clock and return, per step, what each worker runs.

    At each step every worker runs its next action if what it waits for finished in an earlier
    step (F on the previous stage, B on the next stage); otherwise it idles.

    Raises:
        ValueError: if no worker can progress while work remains (the schedule deadlocks).

    Example:
        >>> [[str(a) if a else "." for a in row] for row in simulate(gpipe(1, 2))]
        [['F0'], ['F1'], ['B1'], ['B0']]
    """
    k = schedule.n_workers
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * k
    steps: list[list[Action | None]] = []
    while any(cursor[w] < len(schedule.actions[w]) for w in range(k)):
        row = [_runnable(schedule, w, cursor[w], done) for w in range(k)]
        if not any(row):
            raise _deadlock(schedule, cursor, len(steps))
        for w, action in enumerate(row):
            if action is not None:
                cursor[w] += 1
                done.add((action.stage, action.kind, action.microbatch))
        steps.append(row)
    return steps


def timed(
    schedule: Schedule,
    cost: Callable[[Action, bool], float],
    *,
    transfer: Callable[[Action, Action], float] | None = None,
    start: Sequence[float] | None = None,
) -> dict[Action, float]:
    """Finish time of every action when each takes ``cost(action, split)`` and workers start
    an action as soon as it is next in their list and what it waits for has finished.

    Args:
        schedule: the schedule to time.
        cost: how long an action runs on its worker.
        transfer: ``transfer(dep, action)``, the delay from the end of ``dep`` (an action of
            another stage, or the same stage's earlier F or B) until ``action`` may start: the
            time to move its result. It occupies no worker. None: no delay.
        start: when each worker is free to begin (e.g. after gathering its weights); None:
            all at 0.

    Example:
        >>> max(timed(gpipe(2, 2), lambda a, split: 1.0).values())
        6.0
        >>> send = lambda dep, a: 0.5 if dep.stage != a.stage else 0.0
        >>> max(timed(gpipe(2, 2), lambda a, split: 1.0, transfer=send).values())
        7.0
    """
    delay = transfer or _no_delay
    finish: dict[Action, float] = {}
    clock = [0.0] * schedule.n_workers if start is None else [float(t) for t in start]
    cursor = [0] * schedule.n_workers
    progressed = True
    while progressed:
        progressed = False
        for w, work in enumerate(schedule.waits):
            while cursor[w] < len(work):
                a, deps, split = work[cursor[w]]
                if any(d is None or d not in finish for d in deps):
                    break
                ready = [finish[d] + delay(d, a) for d in deps if d is not None]
                clock[w] = finish[a] = max([clock[w], *ready]) + cost(a, split)
                cursor[w] += 1
                progressed = True
    if any(cursor[w] < len(work) for w, work in enumerate(schedule.actions)):
        raise _deadlock(schedule, cursor, 0)
    return finish


def _no_delay(dep: Action, action: Action) -> float:
    return 0.0


def validate(schedule: Schedule) -> None:
    """Check that a schedule is complete, consistent, runnable and within its memory bound.

    Checks: every stage runs ``F(i)`` and ``B(i)`` once for each micro-batch ``i`` and at most
    one ``W(i)``, after ``B(i)``, and at most one ``R(i)``, after ``F(i)`` and before ``B(i)``;
    ``B(i)`` follows ``F(i)``; each stage is on one worker; the
    workers can run their lists without deadlock; no worker holds more than
    ``max_in_flight[w]`` stage micro-batches at once.

    Raises:
        ValueError: naming the first violation and how to fix it.

    Example:
        >>> validate(zb_v(4, 8))
    """
    if len(schedule.placement) != schedule.n_stages:
        raise ValueError(
            f"placement names {len(schedule.placement)} stages but n_stages="
            f"{schedule.n_stages}; give one worker per stage"
        )
    outside = [s for s, w in enumerate(schedule.placement) if not 0 <= w < schedule.n_workers]
    if outside:
        raise ValueError(
            f"stage(s) {outside} are placed on workers the schedule has no action list for "
            f"({schedule.n_workers} lists); give one list per worker"
        )
    for w, work in enumerate(schedule.actions):
        for a in work:
            if not 0 <= a.stage < schedule.n_stages or schedule.placement[a.stage] != w:
                raise ValueError(
                    f"worker {w} lists {a!r}, but stage {a.stage} is not placed on worker {w}; "
                    "move the action to its stage's worker"
                )
    for s in range(schedule.n_stages):
        _check_stage(schedule, s)
    bound = schedule.max_in_flight
    for w in range(schedule.n_workers):
        if bound is not None and schedule.worker_in_flight(w) > bound[w]:
            raise ValueError(
                f"worker {w} holds {schedule.worker_in_flight(w)} micro-batches at once but the "
                f"schedule allows {bound[w]}; run a backward sooner"
            )
    simulate(schedule)


def _check_stage(schedule: Schedule, s: int) -> None:
    seen: set[tuple[str, int]] = set()
    m = schedule.n_microbatches
    for a in schedule.stage(s):
        key = (a.kind, a.microbatch)
        if a.kind not in ("F", "R", "B", "W") or not 0 <= a.microbatch < m:
            raise ValueError(
                f"stage {s} lists {a!r}; kinds are F/R/B/W and micro-batches 0..{m - 1}"
            )
        if key in seen:
            raise ValueError(f"stage {s} runs {a} twice; each action must appear once")
        before = {"R": "F", "B": "F", "W": "B"}.get(a.kind)
        if before is not None and (before, a.microbatch) not in seen:
            raise ValueError(f"stage {s} runs {a} before {before}{a.microbatch}; move it later")
        if a.kind == "R" and ("B", a.microbatch) in seen:
            raise ValueError(
                f"stage {s} runs {a} after B{a.microbatch}; a recompute rebuilds what B "
                "reads: move it before B"
            )
        seen.add(key)
    missing = [f"{k}{i}" for k in ("F", "B") for i in range(m) if (k, i) not in seen]
    if missing:
        raise ValueError(f"stage {s} never runs {', '.join(missing)}; add them to its list")


def _peak_held(
    work: Sequence[Action],
    schedule: Schedule,
    weight: Sequence[float] | None = None,
    *,
    start: str = "F",
) -> float:
    """Peak of the micro-batches held from their ``start`` action (F, or R for those
    rebuilt) to their last backward action, each weighed by its stage's ``weight``."""
    held, peak = 0.0, 0.0
    for a in work:
        key = (a.stage, a.microbatch)
        last = a.kind == "W" or (a.kind == "B" and not schedule.splits_backward(*key))
        w = 1.0 if weight is None else weight[a.stage]
        if a.kind == start:
            held += w
        elif last and (start == "F" or schedule.rebuilds(*key)):
            held -= w
        peak = max(peak, held)
    return peak


def _runnable(schedule: Schedule, w: int, k: int, done: set[tuple[int, str, int]]) -> Action | None:
    """The action at position ``k`` of worker ``w`` if what it waits for is done."""
    if k >= len(schedule.actions[w]):
        return None
    a = schedule.actions[w][k]
    ready = all(d in done for d in _deps(a, schedule))
    return a if ready else None


def _deadlock(schedule: Schedule, cursor: list[int], step: int) -> ValueError:
    stuck = [
        repr(schedule.actions[w][cursor[w]])
        for w in range(schedule.n_workers)
        if cursor[w] < len(schedule.actions[w])
    ]
    return ValueError(
        f"schedule {schedule.name!r} deadlocks at step {step}: {', '.join(stuck)} wait on each "
        "other; order each stage's forwards like the previous stage's and its backwards like "
        "the next stage's"
    )


def _parse_action(w: int, token: str) -> Action:
    digits = ""
    while token[: len(digits) + 1].isdigit() and len(digits) < len(token):
        digits = token[: len(digits) + 1]
    kind, rest = token[len(digits) : len(digits) + 1].upper(), token[len(digits) + 1 :]
    if kind not in ("F", "R", "B", "W") or not rest.isdigit():
        raise ValueError(
            f"cannot read action {token!r} on worker {w}; write e.g. 'F0', 'R3', 'B3', 'W3' "
            "or '2F0'"
        )
    stage = int(digits) if digits else w
    return Action(stage, kind, int(rest))  # type: ignore[arg-type]


def unit_costs(v: int) -> Callable[[Action, bool], float]:
    """F = R = W = 1, B = 1 (2 for a whole backward), each divided by ``v`` stages per worker."""

    def cost(a: Action, split: bool) -> float:
        return (2.0 if a.kind == "B" and not split else 1.0) / v

    return cost
