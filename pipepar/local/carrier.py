"""How values move between the worker threads of one process (the threads' carrier).

:func:`pipepar.core.executor.walk` runs each worker's list of actions; this carrier says where
their values come from and go. An action takes its input from a
:class:`~pipepar.local.worker.Slots` hand-off point (waiting for the neighbouring stage if it
is not there yet), brought to its stage's device, and hands the result on under the next
stage's key:

* ``F(s, i)`` takes ``(F, s, i)`` and puts ``(F, s+1, i)``;
* ``B(s, i)`` takes ``(B, s, i)`` and puts ``(B, s-1, i)``;
* ``W(s, i)`` needs nothing from elsewhere; it runs unless an idle worker ran it already.

A worker that would wait for an input runs a runnable ``W`` instead (its own, or on a shared
device a neighbour's: :mod:`pipepar.local.weights`), and after its list keeps running those
still to come (the drain). With a tracer, the waits and device moves are recorded, and a
``W`` run by another worker names that worker. What the values are is the compute's business:
a chain's activations and gradients, or a model's empty order tokens.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipepar.core.executor import Step, note_action, walk
from pipepar.core.schedule import Action, Schedule
from pipepar.core.stage import Stage
from pipepar.local.transfer import move
from pipepar.local.weights import WeightQueue
from pipepar.local.worker import IDLE, Aborted, Slots, WorkerPool
from pipepar.recording.tracer import Tracer

__all__ = ["ThreadCarrier"]

Phase = Callable[[Action], bool]


class ThreadCarrier:
    """The hand-offs of one mini-batch between the workers of one process.

    Args:
        stages: the pipe's stages (stage ``s`` runs on worker ``schedule.placement[s]``).
        schedule: what each worker runs.
        shared: the stages whose ``W`` any idle worker on their device may run
            (:func:`~pipepar.local.weights.shared_stages`).
        m: micro-batches.
        tracer: where to record waits and transfers, if anywhere.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Schedule,
        shared: set[int],
        m: int,
        tracer: Tracer | None,
    ) -> None:
        self.stages, self.schedule, self.tracer = stages, schedule, tracer
        self.slots = Slots()
        devices = {schedule.placement[s]: st.device for s, st in enumerate(stages)}
        workers = [devices[w] for w in range(schedule.n_workers)]
        self.weights = WeightQueue(schedule.placement, workers, shared, m)
        self._helper = threading.local()  # .worker: who runs another worker's W right now
        # Per stage, made once: the device its inputs go to, and the question its worker
        # asks while it waits (is there a W to run instead?).
        self._devices = [st.device for st in stages]
        self._idle = [functools.partial(self.weights.runnable, w) for w in schedule.placement]
        self._steps: Sequence[Step] = ()

    # -- running ------------------------------------------------------------------------------
    def execute(
        self,
        steps: Sequence[Step],
        pool: WorkerPool | None,
        phase: Phase,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        """Run the actions ``phase`` selects: on the workers of ``pool``, or with
        ``pool=None`` on the calling thread in an order that never waits. ``autocast``: the
        caller's, entered once per worker (see :meth:`_job`)."""
        self._steps = steps
        if pool is None:
            walk([a for a in self.schedule.serial if phase(a)], steps, self)
            return
        lists = [[a for a in work if phase(a)] for work in self.schedule.actions]
        drain = any(a.kind == "W" for work in lists for a in work)
        pool.run([self._job(w, work, drain, autocast) for w, work in enumerate(lists)], self.slots)

    def _job(
        self,
        worker: int,
        work: list[Action],
        drain: bool,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Callable[[], None]:
        def job() -> None:
            # The caller's autocast held for the whole job, as a plain loop under one autocast
            # holds it: the worker casts each weight once, and every micro-batch's graph saves
            # that one copy (an autocast entered per action would cast, and keep, one each).
            with autocast():
                walk(work, self._steps, self)
                if drain:
                    self._drain(worker)

        return job

    def _drain(self, worker: int) -> None:
        """After its list, a worker runs the W still to come that it may run (on a shared
        device: the other worker's, which is still busy)."""
        q = self.weights
        while q.unfinished(worker):
            self.slots.wait_until(lambda: q.runnable(worker) or not q.unfinished(worker), 1e-3)
            self._idle_weight(worker)

    def _idle_weight(self, worker: int) -> None:
        """Instead of waiting for an input, run a runnable W (see :mod:`.weights`)."""
        claimed = self.weights.claim_any(worker)
        if claimed is None:
            return
        s, i = claimed
        self._helper.worker = None if self.schedule.placement[s] == worker else worker
        try:
            self._steps[s].weight(i)
        except Exception as error:
            self.failed(Action(s, "W", i), error)
            raise
        finally:
            self._helper.worker = None
            self.weights.release(s)

    # -- the carrier seam (pipepar.core.executor.Carrier) ---------------------------------------
    def begin(self, k: int, action: Action) -> None:
        """Stop at once if another worker failed."""
        self.slots.check()

    def take_forward(self, k: int, action: Action) -> Any:
        """Stage ``s``'s input of micro-batch ``i``, on its device."""
        return self._take("F", action.stage, action.microbatch)

    def give_forward(self, k: int, action: Action, y: Any) -> None:
        self.slots.put(("F", action.stage + 1, action.microbatch), y)

    def take_backward(self, k: int, action: Action) -> Any:
        """The gradients of stage ``s``'s output of micro-batch ``i``, on its device."""
        return self._take("B", action.stage, action.microbatch)

    def give_backward(self, k: int, action: Action, grads: Any) -> None:
        s, i = action.stage, action.microbatch
        self.weights.ready(s, i)  # its W may run now, on any worker allowed to
        self.slots.put(("B", s - 1, i), grads)

    def claim_weight(self, k: int, action: Action) -> bool:
        """Hold the listed W's stage (after any earlier W of it another worker runs), unless a
        worker ran it already."""
        return self.weights.claim(action.stage, action.microbatch)

    def release_weight(self, k: int, action: Action) -> None:
        self.weights.release(action.stage)

    def failed(self, action: Action, error: BaseException) -> None:
        """Annotate the error with the stage, micro-batch and phase (not an abort's echo)."""
        if isinstance(error, Exception) and not isinstance(error, Aborted):
            note_action(error, self.stages[action.stage].describe(), action)

    # -- waiting and moving -------------------------------------------------------------------
    def _take(self, kind: str, s: int, i: int) -> object:
        """Wait for the value under ``(kind, s, i)``, running runnable W meanwhile, and bring
        it to stage ``s``'s device."""
        idle, slots = self._idle[s], self.slots
        key = (kind, s, i)
        while True:
            start = time.perf_counter()
            value = slots.take(key, idle)
            if value is not IDLE:
                break
            self._idle_weight(self.schedule.placement[s])
        got = time.perf_counter()
        if self.tracer is not None:
            self.trace(s, i, "wait", start, got)
        device = self._devices[s]
        if _off_device(value, device):
            value = _to(value, device)
            self.trace(s, i, "transfer", got, time.perf_counter())
        return value

    def trace(self, s: int, i: int, kind: str, start: float, end: float) -> None:
        """Record an event, with the worker running it when it runs another worker's W."""
        if self.tracer is not None:
            self.tracer.record(s, i, kind, start, end, getattr(self._helper, "worker", None))


def _items(value: object) -> tuple[Any, ...]:
    return (value,) if isinstance(value, Tensor) else value  # type: ignore[return-value]


def _off_device(value: object, device: torch.device) -> bool:
    if isinstance(value, Tensor):  # the common case, without a generator
        return value.device != device
    return any(t is not None and t.device != device for t in _items(value))


def _to(value: object, device: torch.device) -> object:
    """Move a value (or a tuple of gradients, some None) to ``device``."""
    if isinstance(value, Tensor):
        return move(value, device)
    return tuple(None if t is None else move(t, device) for t in _items(value))
