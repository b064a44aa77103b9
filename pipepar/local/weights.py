"""Deferred weight gradients (W) that an idle worker runs early, its own or a neighbour's.

A zero-bubble schedule places each W where the planner expected its worker to idle, but real
actions take longer or shorter than planned: a worker then waits for an input while a W it
will run later is already runnable. :class:`WeightQueue` lets it run that W instead of
waiting, and, when two workers compute on the same device (CPU stages share the memory), it
may take a W of a stage on the other worker, which balances the two workers' load; a worker
whose list is done keeps taking such W until none is left to come.

Only stages whose every micro-batch splits its backward take part: their parameter gradients
are summed in W alone, and the queue runs a stage's W in micro-batch order, one at a time (a
lock per stage), so the sums are added in the same order as in the listed schedule and a run
stays bit-for-bit repeatable whichever worker runs them. Other stages' W run where listed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from pipepar.core.schedule import Schedule

__all__ = ["WeightQueue", "shared_stages"]


class WeightQueue:
    """The runnable W of one mini-batch, per stage in micro-batch order.

    Args:
        placement: the worker of each stage.
        devices: the device of each worker.
        shared: the stages that take part (every micro-batch split into B and W).
        m: micro-batches per stage (for :meth:`unfinished`).

    Example:
        >>> q = WeightQueue((0, 1), [torch.device("cpu")] * 2, shared={0, 1}, m=4)
        >>> q.ready(0, 3)
        >>> q.claim_any(1)  # worker 1 may run stage 0's W: both compute on the CPU
        (0, 3)
        >>> q.release(0)
        >>> q.claim(0, 3)  # worker 0 reaches W(0, 3) in its list: already run
        False
    """

    def __init__(
        self,
        placement: Sequence[int],
        devices: Sequence[torch.device],
        shared: set[int],
        m: int,
    ) -> None:
        self._lock = threading.Lock()
        self._ready: dict[int, deque[int]] = {s: deque() for s in sorted(shared)}
        self._busy = {s: threading.Lock() for s in shared}
        self._taken: set[tuple[int, int]] = set()
        self._m = m
        self._allowed = [_allowed(w, placement, devices, shared) for w in range(len(devices))]

    def ready(self, stage: int, microbatch: int) -> None:
        """B of ``microbatch`` on ``stage`` is done: its W may run."""
        if stage in self._busy:
            with self._lock:
                self._ready[stage].append(microbatch)

    def runnable(self, worker: int) -> bool:
        """True if ``worker`` could claim a W now."""
        with self._lock:
            return any(self._ready[s] and not self._busy[s].locked() for s in self._allowed[worker])

    def unfinished(self, worker: int) -> bool:
        """True while a W that ``worker`` may run is not yet claimed (or not yet runnable)."""
        with self._lock:
            taken = sum(1 for s, _ in self._taken if s in self._allowed[worker])
        return taken < self._m * len(self._allowed[worker])

    def claim_any(self, worker: int) -> tuple[int, int] | None:
        """The oldest runnable W of a stage ``worker`` may run (its own stages first), held
        until :meth:`release`; ``None`` if there is none."""
        with self._lock:
            for s in self._allowed[worker]:
                if self._ready[s] and self._busy[s].acquire(blocking=False):
                    i = self._ready[s].popleft()
                    self._taken.add((s, i))
                    return s, i
        return None

    def claim(self, stage: int, microbatch: int) -> bool:
        """Claim the listed W(``stage``, ``microbatch``) for its own worker: True, held until
        :meth:`release` (after any earlier W of the stage another worker is running), or False
        if a worker ran it already."""
        if stage not in self._busy:
            return True
        with self._lock:
            if (stage, microbatch) in self._taken:
                return False
            queue = self._ready[stage]
            if not queue or queue[0] != microbatch:
                raise RuntimeError(
                    f"pipepar schedule bug: W{microbatch} of stage {stage} listed before its B "
                    f"or out of order (runnable: {list(queue)})"
                )
            # Blocking under the queue lock keeps the order: no other worker can take a later
            # W of this stage before this one starts. The holder never needs the queue lock.
            self._busy[stage].acquire()
            queue.popleft()
            self._taken.add((stage, microbatch))
        return True

    def release(self, stage: int) -> None:
        """The claimed W of ``stage`` has run (or failed)."""
        if stage in self._busy:
            self._busy[stage].release()


def _allowed(
    worker: int, placement: Sequence[int], devices: Sequence[torch.device], shared: set[int]
) -> list[int]:
    """Stages whose W ``worker`` may run: its own, then those of workers on its device."""
    own = [s for s in sorted(shared) if placement[s] == worker]
    near = [
        s
        for s in sorted(shared)
        if placement[s] != worker and devices[placement[s]] == devices[worker]
    ]
    return own + near


def shared_stages(schedule: Schedule) -> set[int]:
    """The stages whose every micro-batch splits its backward and whose worker lists their W
    in micro-batch order (the order the queue keeps)."""
    m, shared = schedule.n_microbatches, set()
    for s in range(schedule.n_stages):
        listed = [a.microbatch for a in schedule.stage(s) if a.kind == "W"]
        if listed == list(range(m)) and all(schedule.splits_backward(s, i) for i in range(m)):
            shared.add(s)
    return shared
