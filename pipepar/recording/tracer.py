"""Recording what each stage did and when, and reading it back as a pipeline timeline.

The engine calls :meth:`Tracer.record` around every action of a stage when the pipe has a
tracer (``pipepar.wrap(..., trace=True)``, or for one block with :func:`tracing`). Kinds:

- ``"wait"``: the stage is blocked until its neighbour hands over the input (or gradient);
- ``"transfer"``: the input is being moved to the stage's device;
- ``"forward"`` / ``"backward"``: the stage computes micro-batch ``i``;
- ``"weight"``: the parameter gradients a zero-bubble schedule deferred from the backward;
- ``"recompute"``: a checkpointed forward re-run inside the backward (nested in it).

Without a tracer the engine only skips a ``None`` check per action, so recording costs nothing
when off; when on, it costs a few microseconds per action (``benchmarks/bench_overhead.py``).
Times are host-side ``perf_counter`` readings: on CPU they are the computation; on CUDA, where
kernels run asynchronously, they show when the work was issued and waited for. A
:class:`Timeline` turns the events into figures (busy time per stage, the bubble, one timeline
per mini-batch) and draws them (:mod:`pipepar.timeline`).

    >>> with tracing(pipe) as tracer:
    ...     pipe(x).sum().backward()
    >>> timeline = tracer.timeline()
    >>> print(timeline.summary())
    >>> pipepar.timeline.save(timeline, "pipeline.svg")
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipepar.core.schedule import Schedule

__all__ = ["COMPUTE", "KINDS", "Event", "Timeline", "Tracer", "tracing"]

KINDS = ("wait", "transfer", "forward", "backward", "weight", "recompute")
"""Every kind of event the engine records."""
COMPUTE = ("forward", "backward", "weight")
"""The kinds that are scheduled actions (``"weight"``: a W deferred by a zero-bubble
schedule); ``"recompute"`` happens inside a ``"backward"``."""


@dataclass(frozen=True)
class Event:
    """One action of one stage; ``kind`` is one of :data:`KINDS`, times are in seconds."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float
    worker: int | None = None
    """The worker that ran it, when not the stage's own (an idle worker may run another
    stage's deferred weight gradients on a shared device)."""

    def lane(self, placement: Sequence[int]) -> int:
        """The worker that ran it: ``worker`` if set, else its stage's (``placement[stage]``)."""
        return placement[self.stage] if self.worker is None else self.worker

    def shifted(self, by: float) -> Event:
        """The same event ``by`` seconds later."""
        return dataclasses.replace(self, start=self.start + by, end=self.end + by)

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start

    @property
    def label(self) -> str:
        """Short name such as ``F3`` (forward of micro-batch 3), ``B0``, ``R2``, ``W1``."""
        return f"{_LETTERS.get(self.kind, self.kind[:1].upper())}{self.microbatch}"


_LETTERS = {
    "forward": "F",
    "backward": "B",
    "weight": "W",
    "recompute": "R",
    "wait": "w",
    "transfer": "T",
}


class Tracer:
    """Collects :class:`Event` records from the stage workers (thread-safe).

    Events accumulate until :meth:`clear`; a long training run with ``trace=True`` keeps every
    event, so trace a few steps (see :func:`tracing`) rather than a whole epoch.

    Example:
        >>> tracer = Tracer()
        >>> tracer.record(0, 0, "forward", 1.0, 1.5)
        >>> tracer.timeline().span
        0.5
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def record(
        self,
        stage: int,
        microbatch: int,
        kind: str,
        start: float,
        end: float,
        worker: int | None = None,
    ) -> None:
        """Add one event; times are ``time.perf_counter()`` readings; ``worker`` if another
        worker than the stage's own ran it."""
        with self._lock:
            self.events.append(Event(stage, microbatch, kind, start, end, worker))

    def clear(self) -> None:
        """Forget all events and restart the clock."""
        with self._lock:
            self.events.clear()
            self.origin = time.perf_counter()

    def timeline(self) -> Timeline:
        """The events recorded so far as a :class:`Timeline` (a snapshot)."""
        with self._lock:
            return Timeline(list(self.events))


@contextlib.contextmanager
def tracing(pipe: Any) -> Iterator[Tracer]:
    """Record the pipe's actions inside the ``with`` block into a fresh :class:`Tracer`.

    The pipe's previous tracer (``None`` unless built with ``trace=True``) is restored on exit.
    A mini-batch whose forward ran inside the block is recorded completely, backward included,
    even if ``backward()`` is called after the block.

    Args:
        pipe: a :class:`pipepar.Pipe` (anything with a ``tracer`` attribute the engine reads).

    Example:
        >>> with pipepar.tracing(pipe) as tracer:
        ...     pipe(x).sum().backward()
        >>> tracer.timeline().bubble  # doctest: +SKIP
        0.21

    Yields:
        The :class:`Tracer` recording the block; ``tracer.timeline()`` reads it.

    Raises:
        TypeError: ``pipe`` is not a pipe (it has no ``tracer``).
    """
    if not hasattr(pipe, "tracer"):
        raise TypeError(
            f"tracing() needs a pipe built by pipepar.wrap, but got {type(pipe).__name__}; "
            "wrap the model first: pipe = pipepar.wrap(model, balance, chunks=...)"
        )
    previous, tracer = pipe.tracer, Tracer()
    pipe.tracer = tracer
    try:
        yield tracer
    finally:
        pipe.tracer = previous


class Timeline:
    """Events of a real run, with times in seconds since its first event.

    Build one with :meth:`Tracer.timeline`. ``steps()`` splits it into one timeline per
    mini-batch; ``bubble`` is the measured idle fraction, ``ideal_bubble`` the GPipe bound
    ``(K-1)/(M+K-1)``; ``save(path)`` draws it (``.svg``, ``.png``) or exports it (``.json``,
    a Chrome trace for Perfetto).

    Attributes:
        events: the events, sorted by start time; times relative to :attr:`origin`.
        origin: the ``time.perf_counter()`` reading that is time 0 here.

    Example:
        >>> timeline = pipe.tracer.timeline().steps()[-1]
        >>> timeline.n_stages, timeline.n_microbatches, round(timeline.bubble, 2)
        (2, 4, 0.23)
    """

    def __init__(self, events: Iterable[Event], *, origin: float | None = None) -> None:
        raw = sorted(events, key=lambda e: (e.start, e.stage, e.end))
        self.origin = raw[0].start if origin is None and raw else (origin or 0.0)
        self.events: tuple[Event, ...] = tuple(e.shifted(-self.origin) for e in raw)

    # -- shape --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return (
            f"Timeline({len(self.events)} events, {self.n_stages} stages, "
            f"{self.n_microbatches} micro-batches, span {self.span * 1e3:.2f} ms)"
        )

    @property
    def n_stages(self) -> int:
        """Number of stages that recorded an event (K)."""
        return 1 + max((e.stage for e in self.events), default=-1)

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per mini-batch (M): one more than the largest index seen."""
        return 1 + max((e.microbatch for e in self.events), default=-1)

    @property
    def start(self) -> float:
        """Start of the first event (0 unless built with an explicit origin)."""
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        """End of the last event."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def span(self) -> float:
        """Seconds from the first event's start to the last event's end (the makespan)."""
        return self.end - self.start

    # -- figures ------------------------------------------------------------------------------
    def of_stage(self, stage: int) -> list[Event]:
        """The events of one stage, in start order."""
        return [e for e in self.events if e.stage == stage]

    def seconds(self, stage: int, kind: str) -> float:
        """Total seconds stage ``stage`` spent in events of ``kind`` (see :data:`KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {KINDS}; pass e.g. kind='forward'")
        return sum(e.duration for e in self.events if e.stage == stage and e.kind == kind)

    def busy(self, stage: int) -> float:
        """Seconds stage ``stage`` computed: forward plus backward (recompute is inside it)."""
        return sum(self.seconds(stage, kind) for kind in COMPUTE)

    @property
    def bubble(self) -> float:
        """Measured idle fraction: ``1 - sum(busy) / (K * span)`` (waits and transfers idle)."""
        k, span = self.n_stages, self.span
        if k == 0 or span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(j) for j in range(k)) / (k * span)

    @property
    def ideal_bubble(self) -> float:
        """The schedule's bound ``(K-1)/(M+K-1)``, for stages of equal cost and free hand-offs."""
        k, m = self.n_stages, self.n_microbatches
        return (k - 1) / (m + k - 1) if k and m else 0.0

    def summary(self) -> str:
        """A per-stage table of busy, forward, backward, recompute, wait and transfer ms."""
        head = (
            f"{self.n_stages} stages x {self.n_microbatches} micro-batches, "
            f"span {self.span * 1e3:.2f} ms, bubble {self.bubble:.1%} "
            f"(ideal {self.ideal_bubble:.1%})"
        )
        cols = ["busy", *COMPUTE, "recompute", "wait", "transfer"]
        rows = ["stage " + "".join(f"{c:>12}" for c in cols) + "      idle"]
        for j in range(self.n_stages):
            busy = self.busy(j)
            cells = [busy] + [self.seconds(j, c) for c in cols[1:]]
            idle = 1.0 - busy / self.span if self.span > 0 else 0.0
            times = "".join(f"{v * 1e3:>9.2f} ms" for v in cells)
            rows.append(f"{j:>5} {times}{idle:>9.1%}")
        return "\n".join([head, *rows])

    # -- structure ----------------------------------------------------------------------------
    def steps(self) -> list[Timeline]:
        """One timeline per mini-batch, each starting at its own time 0.

        A mini-batch starts where stage 0 runs the forward of micro-batch 0; waits and
        transfers belong to the action they precede.
        """
        firsts = [e.start for e in self.events if _is_first_action(e)]
        if len(firsts) <= 1:
            return [self] if self.events else []
        groups: list[list[Event]] = [[] for _ in firsts]
        for event, anchor in zip(self.events, self._anchors()):
            groups[max(0, bisect.bisect_right(firsts, anchor) - 1)].append(event)
        return [Timeline(_absolute(g, self.origin)) for g in groups if g]

    def by_worker(self, placement: Sequence[int]) -> Timeline:
        """The same events with one lane per worker (device or rank) instead of per stage:
        ``placement[s]`` is the worker of stage ``s`` (``pipe.schedule.placement``). Useful for
        virtual-stage schedules, where a worker runs several stages.

        Example:
            >>> tl = pipe.tracer.timeline().by_worker(pipe.schedule.placement)
        """
        moved = [
            Event(e.lane(placement), e.microbatch, e.kind, e.start, e.end) for e in self.events
        ]
        return Timeline(moved, origin=0.0)

    def actions(self, stage: int) -> list[str]:
        """The scheduled actions of one stage in the order they ran, e.g. ``["F0", "F1", "B1"]``."""
        return [e.label for e in self.events if e.stage == stage and e.kind in COMPUTE]

    def schedule(self) -> Schedule:
        """The order each stage ran its actions, as a :class:`pipepar.schedule.Schedule`.

        Compare it with the intended one, e.g. ``timeline.schedule().actions ==
        pipepar.schedule.gpipe(2, 4).actions``, or print it as a step x stage grid.
        """
        from pipepar.core.schedule import parse

        n_steps = len(self.steps())
        if n_steps > 1:
            raise ValueError(
                f"this timeline holds {n_steps} mini-batches; pick one first: "
                "timeline.steps()[i].schedule()"
            )
        return parse([" ".join(self.actions(j)) for j in range(self.n_stages)], name="observed")

    def _anchors(self) -> list[float]:
        """For each event, the start of the action it belongs to (a wait: the next action)."""
        starts: dict[tuple[int, int], list[float]] = {}
        for e in self.events:
            if e.kind in COMPUTE:
                starts.setdefault((e.stage, e.microbatch), []).append(e.start)
        anchors = []
        for e in self.events:
            mine = starts.get((e.stage, e.microbatch), [])
            if e.kind in ("wait", "transfer"):
                k = bisect.bisect_left(mine, e.end)
                anchors.append(mine[k] if k < len(mine) else e.start)
            else:
                anchors.append(e.start)
        return anchors


def _is_first_action(event: Event) -> bool:
    return event.stage == 0 and event.microbatch == 0 and event.kind == "forward"


def _absolute(events: Sequence[Event], origin: float) -> list[Event]:
    return [e.shifted(origin) for e in events]
