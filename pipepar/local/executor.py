"""Run a schedule in one process: a worker thread per device walks its action list.

The schedule (:mod:`pipepar.core.schedule`) says what each worker does and in which order; the
step (:mod:`pipepar.core.step`) computes each action; this module only moves values. A worker
takes an action's input from a :class:`~pipepar.local.worker.Slots` hand-off point (waiting for
the neighbouring stage if it is not there yet), brings it to its device, calls the step, and
hands the result on under the next stage's key:

* ``F(s, i)`` takes ``(F, s, i)`` and puts ``(F, s+1, i)``;
* ``B(s, i)`` takes ``(B, s, i)`` and puts ``(B, s-1, i)``;
* ``W(s, i)`` needs nothing from elsewhere.

:class:`Run` holds one mini-batch: the inputs of stage 0 are put before the workers start; the
last stage's outputs (``(F, n, i)``) and the first stage's input gradients (``(B, -1, i)``)
are what the pipe gives back.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipepar.core.errors import add_note
from pipepar.core.microbatch import Value, tensors
from pipepar.core.randomness import DrawLog, Randomness, Recorded, Streams
from pipepar.core.schedule import Action, Schedule, simulate
from pipepar.core.stage import Stage
from pipepar.core.step import Grads, Head, StageStep
from pipepar.local.transfer import move
from pipepar.local.weights import WeightQueue, shared_stages
from pipepar.local.worker import IDLE, Aborted, Slots, WorkerPool, run_inline
from pipepar.recording.tracer import Tracer

__all__ = ["Run"]

Phase = Callable[[Action], bool]
EVERY: Phase = lambda a: True  # noqa: E731
FORWARD: Phase = lambda a: a.kind == "F"  # noqa: E731
BACKWARD: Phase = lambda a: a.kind != "F"  # noqa: E731


class Run:
    """One mini-batch of a pipe: the steps of its stages and the hand-offs between them.

    Args:
        stages: the pipe's stages (stage ``s`` runs on worker ``schedule.placement[s]``).
        schedule: what each worker runs.
        microbatches: stage 0's inputs.
        checkpoint: recompute mode.
        grad: whether a backward follows.
        input_requires_grad: whether the caller wants gradients of the inputs.
        head: applied to the last stage's outputs inside its graph (``Pipe.step``'s loss).
        tracer: where to record a timeline, if any.
        draws: the pipe's record of which stages draw random numbers (kept across
            mini-batches, so stages that draw nothing run without the random-stream mode).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Schedule,
        microbatches: list[Value],
        *,
        checkpoint: str,
        grad: bool,
        input_requires_grad: bool,
        head: Head | None = None,
        tracer: Tracer | None = None,
        draws: DrawLog | None = None,
    ) -> None:
        self.stages, self.schedule, self.m = list(stages), schedule, len(microbatches)
        self.tracer = tracer
        training = any(layer.training for s in stages for layer in s.layers)
        # Several workers race for the generator: a stream per (stage, micro-batch) keeps runs
        # repeatable. One worker draws in order, as the plain model does; it only needs to
        # remember its draws if it will recompute.
        recompute = grad and training and checkpoint != "never"
        flags = {s.index: tuple(layer.training for layer in s.layers) for s in stages}
        streams: Randomness | None = (
            Streams(log=draws, flags=flags)
            if schedule.n_workers > 1
            else Recorded()
            if recompute
            else None
        )
        record = self._trace if tracer is not None else None
        n = len(self.stages)
        self.steps = [
            StageStep(
                stage,
                self.m,
                checkpoint=checkpoint,
                grad=grad,
                input_grad=stage.index > 0 or input_requires_grad,
                streams=streams,
                split=functools.partial(schedule.splits_backward, stage.index),
                head=head if stage.index == n - 1 else None,
                record=record,
            )
            for stage in self.stages
        ]
        self.training = training
        self._queue_weights(shared_stages(schedule))
        self.slots = Slots()
        for i, x in enumerate(microbatches):
            self.slots.put(("F", 0, i), x)
        self.out_sizes: list[int] = []

    def _queue_weights(self, shared: set[int]) -> None:
        """Make the queue of runnable W (:mod:`pipepar.local.weights`): the W of the ``shared``
        stages may run early, on any idle worker computing on the same device."""
        devices = {self.schedule.placement[s]: st.device for s, st in enumerate(self.stages)}
        workers = [devices[w] for w in range(self.schedule.n_workers)]
        self.weights = WeightQueue(self.schedule.placement, workers, shared, self.m)
        self._thief = threading.local()  # .worker: who runs another worker's W right now

    # -- running ------------------------------------------------------------------------------
    def execute(self, pool: WorkerPool | None, phase: Phase) -> None:
        """Run the schedule's actions that ``phase`` selects: on the workers of ``pool``, or
        with ``pool=None`` on the calling thread, in an order that never waits; then let the
        random streams check the blocks that ran (:meth:`Randomness.close`)."""
        try:
            self._execute(pool, phase)
        finally:
            streams = self.steps[0].streams if self.steps else None
            if streams is not None:
                streams.close()

    def _execute(self, pool: WorkerPool | None, phase: Phase) -> None:
        if pool is None:
            order = [a for row in simulate(self.schedule) for a in row if a is not None]
            run_inline([self._bound(a) for a in order if phase(a)])
            return
        lists = [[a for a in work if phase(a)] for work in self.schedule.actions]
        drain = any(a.kind == "W" for work in lists for a in work)
        pool.run([self._job(w, work, drain) for w, work in enumerate(lists)], self.slots)

    def _job(self, worker: int, work: list[Action], drain: bool) -> Callable[[], None]:
        def job() -> None:
            # The caller's autocast held for the whole job, as a plain loop under one autocast
            # holds it: the worker casts each weight once, and every micro-batch's graph saves
            # that one copy (an autocast entered per action would cast, and keep, one each).
            with self.steps[0].autocast():
                for action in work:
                    self.slots.check()
                    if action.kind != "W":
                        self.act(action)
                    elif self.weights.claim(action.stage, action.microbatch):
                        self._weight(action)
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

    def _weight(self, action: Action) -> None:
        """Run a claimed W, then let the next W of its stage be claimed."""
        try:
            self.act(action)
        finally:
            self.weights.release(action.stage)

    def _idle_weight(self, worker: int) -> None:
        """Instead of waiting for an input, run a runnable W (see :mod:`.weights`)."""
        claimed = self.weights.claim_any(worker)
        if claimed is None:
            return
        own = self.schedule.placement[claimed[0]] == worker
        self._thief.worker = None if own else worker
        try:
            self._weight(Action(claimed[0], "W", claimed[1]))
        finally:
            self._thief.worker = None

    def _bound(self, action: Action) -> Callable[[], None]:
        return lambda: self.act(action)

    def act(self, action: Action) -> None:
        """Run one action; a failure is annotated with the stage, micro-batch and phase."""
        try:
            self._dispatch(action)
        except Exception as error:
            if not isinstance(error, Aborted) and not getattr(error, "_pipepar_noted", False):
                phase = {"F": "forward", "B": "backward", "W": "weight gradients"}[action.kind]
                where = self.stages[action.stage].describe()
                add_note(
                    error, f"pipepar: raised in {where}, micro-batch {action.microbatch}, {phase}"
                )
                error._pipepar_noted = True  # type: ignore[attr-defined]
            raise

    def _dispatch(self, action: Action) -> None:
        s, i = action.stage, action.microbatch
        step = self.steps[s]
        if action.kind == "F":
            x = self._receive("F", s, i)
            self.slots.put(("F", s + 1, i), step.forward(i, x))  # type: ignore[arg-type]
        elif action.kind == "B":
            g = self._receive("B", s, i)
            grads = step.backward(i, g)  # type: ignore[arg-type]
            self.weights.ready(s, i)
            self.slots.put(("B", s - 1, i), grads)
        else:
            step.weight(i)

    def _receive(self, kind: str, s: int, i: int) -> object:
        """Wait for stage ``s``'s input of micro-batch ``i`` and bring it to its device."""
        device, worker = self.stages[s].device, self.schedule.placement[s]
        idle = functools.partial(self.weights.runnable, worker)
        while True:
            start = time.perf_counter()
            value = self.slots.take((kind, s, i), idle)
            if value is not IDLE:
                break
            self._idle_weight(worker)
        got = time.perf_counter()
        self._trace(s, i, "wait", start, got)
        if _off_device(value, device):
            value = _to(value, device)
            self._trace(s, i, "transfer", got, time.perf_counter())
        return value

    def _trace(self, s: int, i: int, kind: str, start: float, end: float) -> None:
        """Record an event, with the worker running it when it runs another worker's W."""
        if self.tracer is not None:
            self.tracer.record(s, i, kind, start, end, getattr(self._thief, "worker", None))

    # -- what goes in and out -----------------------------------------------------------------
    def outputs(self) -> list[Value]:
        """The last stage's outputs, in micro-batch order (after the forward actions ran)."""
        n = len(self.stages)
        outs: list[Value] = [self.slots.take(("F", n, i)) for i in range(self.m)]  # type: ignore[misc]
        self.out_sizes = [tensors(v)[0].shape[0] if tensors(v)[0].dim() else 1 for v in outs]
        return outs

    def seed_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """Split the gradient of the joined output into per-micro-batch gradients."""
        parts = [g.split(self.out_sizes) if g is not None else [None] * self.m for g in grads]
        for i in range(self.m):
            self.slots.put(("B", len(self.stages) - 1, i), tuple(p[i] for p in parts))

    def seed_loss(self, i: int, seed: float) -> None:
        """Start the backward of micro-batch ``i`` from ``seed`` (its loss's share, times a
        loss scaler's scale)."""
        last = self.stages[-1].device
        self.slots.put(("B", len(self.stages) - 1, i), (torch.tensor(seed, device=last),))

    def input_grads(self) -> list[Tensor | None]:
        """Gradients of the pipeline's input tensors (after all backward actions ran)."""
        columns = list(zip(*self._each_input_grads()))
        return [None if any(g is None for g in col) else torch.cat(col) for col in columns]  # type: ignore[arg-type]

    def microbatch_input_grads(self) -> list[Tensor | None]:
        """Gradients of each micro-batch's input tensors, micro-batch by micro-batch."""
        return [g for grads in self._each_input_grads() for g in grads]

    def _each_input_grads(self) -> list[Grads]:
        return [self.slots.take(("B", -1, i)) for i in range(self.m)]  # type: ignore[misc]

    def take_param_grads(self) -> list[Tensor | None]:
        """Per-parameter gradient sums, stage by stage, in ``stage.trainable()`` order; the
        steps forget them (so they can become ``.grad`` without a copy)."""
        grads = [g for step in self.steps for g in step.param_grads()]
        for step in self.steps:
            step.release()
        return grads


def _items(value: object) -> tuple[Any, ...]:
    return (value,) if isinstance(value, Tensor) else value  # type: ignore[return-value]


def _off_device(value: object, device: torch.device) -> bool:
    return any(t is not None and t.device != device for t in _items(value))


def _to(value: object, device: torch.device) -> object:
    """Move a value (or a tuple of gradients, some None) to ``device``."""
    if isinstance(value, Tensor):
        return move(value, device)
    return tuple(None if t is None else move(t, device) for t in _items(value))
