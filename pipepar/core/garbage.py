"""Python's cycle collector around a pipe's steps (``gc_every=`` of ``wrap``).

The collector runs when allocations pass its thresholds, in whatever thread allocates, and a
full pass walks every object the process tracks: about 0.2 s in a process that imported
transformers (some 400 000 objects). A pipe's step makes thousands of short-lived tracked
objects (autograd nodes read from Python, tensors, hooks), some of which the collector
promotes while the step keeps them alive; a plain training loop makes almost none. So a pipe
sets off a full pass now and then (GPT-2 on two CPU ranks: about once per hundred steps per
rank), and across ranks each rank pauses at a step of its own while the others wait for it:
with many ranks, some rank pauses at most steps.

:class:`StepCollector` is the remedy large training codes use (e.g. Megatron-LM's manual
garbage collection): the automatic collector is off while a step runs, the young generations
are collected after each step (what the step left alive: about a millisecond here), and a full
pass runs every ``every`` steps, the same step on every rank, since every rank steps together.
Cyclic garbage made during a step waits for the step's end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["StepCollector", "check_gc_every"]


class _Running:
    """The steps running in this process under a collector, and whether Python's collector
    was on before the first of them."""

    lock = threading.Lock()
    depth = 0
    was_on = True


def check_gc_every(every: object) -> int | None:
    """``every`` as given to ``wrap(gc_every=...)``: None or a positive int."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(
            f"gc_every must be None or an int, but got {type(every).__name__} {every!r}; pass "
            "e.g. gc_every=100 (a full collection every 100 steps) or None"
        )
    if every < 1:
        raise ValueError(
            f"gc_every must be at least 1, but got {every}; pass e.g. gc_every=100, or None to "
            "leave Python's collector as it is"
        )
    return every


class StepCollector:
    """Python's collector off during each step, young objects collected after it, and a full
    collection every ``every`` steps; ``every=None`` leaves the collector alone.

    Steps of several pipes may overlap (threads): the collector is back on when the last one
    ends, as it was before the first.

    Example:
        >>> collector = StepCollector(2)
        >>> with collector.step():
        ...     gc.isenabled()
        False
        >>> gc.isenabled(), collector.steps
        (True, 1)
    """

    def __init__(self, every: int | None) -> None:
        self.every = check_gc_every(every)
        self.steps = 0
        """Steps run through :meth:`step` (a full collection after every ``every``-th)."""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one step under this policy."""
        if self.every is None:
            yield
            return
        _enter()
        try:
            yield
        finally:
            self.steps += 1
            gc.collect() if self.steps % self.every == 0 else gc.collect(1)
            _leave()


def _enter() -> None:
    with _Running.lock:
        if _Running.depth == 0:
            _Running.was_on = gc.isenabled()
            gc.disable()
        _Running.depth += 1


def _leave() -> None:
    with _Running.lock:
        _Running.depth -= 1
        if _Running.depth == 0 and _Running.was_on:
            gc.enable()
