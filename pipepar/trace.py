"""Recording what each stage did and when (the pipeline timeline)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["Event", "Tracer"]


@dataclass(frozen=True)
class Event:
    """One action of one stage: ``kind`` is "forward", "backward" or "recompute"."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


class Tracer:
    """Collects :class:`Event` records from the stage workers (thread-safe)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def record(self, stage: int, microbatch: int, kind: str, start: float, end: float) -> None:
        """Add one event; times are ``time.perf_counter()`` readings."""
        with self._lock:
            self.events.append(Event(stage, microbatch, kind, start, end))

    def clear(self) -> None:
        """Forget all events and restart the clock."""
        with self._lock:
            self.events.clear()
            self.origin = time.perf_counter()
