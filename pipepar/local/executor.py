"""Run a schedule in one process: a worker thread per device walks its action list.

The schedule (:mod:`pipepar.core.schedule`) says what each worker does and in which order; the
step (:mod:`pipepar.core.step`) computes each action; :func:`pipepar.core.executor.walk` walks
each worker's list, and :class:`~pipepar.local.carrier.ThreadCarrier` hands the values on
between the workers. :class:`ThreadRun` is what every compute of one process shares (the
carrier, running a phase of the schedule, the parameter gradients); :class:`Run` is a chain's
mini-batch: the inputs of stage 0 are put before the workers start; the last stage's outputs
(``(F, n, i)``) and the first stage's input gradients (``(B, -1, i)``) are what the pipe gives
back. A model cut while it runs has its own (:class:`pipepar.program.run.ProgramRun`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from pipepar.core.microbatch import Value, tensors
from pipepar.core.offload_plan import offloader_for
from pipepar.core.randomness import DrawLog, Randomness, Recorded, Streams
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import Grads, Head, Recorder, StageStep
from pipepar.local.carrier import Phase, ThreadCarrier
from pipepar.local.weights import shared_stages
from pipepar.local.worker import WorkerPool
from pipepar.recording.tracer import Tracer

__all__ = ["Run", "RunKind", "ThreadRun", "both_recorders"]

EVERY: Phase = lambda a: True  # noqa: E731
FORWARD: Phase = lambda a: a.kind == "F"  # noqa: E731
BACKWARD: Phase = lambda a: a.kind != "F"  # noqa: E731
_PHASES = {EVERY: "every action", FORWARD: "forwards", BACKWARD: "backwards"}


class RunKind(NamedTuple):
    """What makes runs alike in cost (:meth:`ThreadRun.kind`)."""

    phase: str
    schedule: int
    """The schedule's ``id`` (one object per layout and micro-batch count, kept by the pipe)."""
    training: bool
    backward: bool
    """Whether a backward follows the forwards."""


class ThreadRun:
    """One mini-batch on the worker threads: its steps (made by the subclass, the compute)
    and the carrier between them.

    Args:
        stages: the pipe's stages (stage ``s`` runs on worker ``schedule.placement[s]``).
        schedule: what each worker runs.
        m: micro-batches.
        shared: the stages whose W an idle worker may run early
            (:func:`~pipepar.local.weights.shared_stages`).
        tracer: where to record a timeline, if any.
    """

    steps: Sequence[StageStep]

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Schedule,
        m: int,
        shared: set[int],
        tracer: Tracer | None,
    ) -> None:
        self.stages, self.schedule, self.m = list(stages), schedule, m
        self.tracer = tracer
        self.carrier = ThreadCarrier(self.stages, schedule, shared, m, tracer)
        self.slots = self.carrier.slots
        self.training = any(layer.training for s in stages for layer in s.layers)
        self.out_sizes: list[int] = []

    @property
    def record(self) -> Callable[[int, int, str, float, float], None] | None:
        """What the steps record their events with (None without a tracer)."""
        return self.carrier.trace if self.tracer is not None else None

    def execute(self, pool: WorkerPool | None, phase: Phase) -> None:
        """Run the schedule's actions that ``phase`` selects: on the workers of ``pool``, or
        with ``pool=None`` on the calling thread, in an order that never waits; then let the
        random streams check the blocks that ran (:meth:`Randomness.close`)."""
        try:
            autocast = self.steps[0].autocast if self.steps else _no_autocast
            self.carrier.execute(self.steps, pool, phase, autocast)
        finally:
            streams = self.steps[0].streams if self.steps else None
            if streams is not None:
                streams.close()

    def kind(self, phase: Phase) -> RunKind:
        """What makes runs of ``phase`` alike in cost: the schedule, training or not, and
        whether a backward follows (:mod:`pipepar.local.thread_choice` times each kind)."""
        grad = bool(self.steps) and self.steps[0].grad
        return RunKind(_PHASES.get(phase, "actions"), id(self.schedule), self.training, grad)

    def take_param_grads(self) -> list[Tensor | None]:
        """Per-parameter gradient sums, stage by stage, in ``stage.trainable()`` order; the
        steps forget them (so they can become ``.grad`` without a copy)."""
        grads = [g for step in self.steps for g in step.param_grads()]
        for step in self.steps:
            step.release()
        return grads


class Run(ThreadRun):
    """One mini-batch of a chain: the steps of its stages and the hand-offs between them.

    Args:
        stages: the pipe's stages (stage ``s`` runs on worker ``schedule.placement[s]``).
        schedule: what each worker runs.
        microbatches: stage 0's inputs.
        checkpoint: recompute mode.
        offload: whether saved activations go to host memory between F and B.
        grad: whether a backward follows.
        input_requires_grad: whether the caller wants gradients of the inputs.
        head: applied to the last stage's outputs inside its graph (``Pipe.step``'s loss).
        tracer: where to record a timeline, if any.
        draws: the pipe's record of which stages draw random numbers (kept across
            mini-batches, so stages that draw nothing run without the random-stream mode).
        timing: also told about each computation (the stages' times), if given.
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
        offload: bool = False,
        head: Head | None = None,
        tracer: Tracer | None = None,
        draws: DrawLog | None = None,
        timing: Recorder | None = None,
    ) -> None:
        super().__init__(stages, schedule, len(microbatches), shared_stages(schedule), tracer)
        # Several workers race for the generator: a stream per (stage, micro-batch) keeps runs
        # repeatable. One worker draws in order, as the plain model does; it only needs to
        # remember its draws if it will recompute.
        recompute = grad and self.training and checkpoint != "never"
        flags = {s.index: tuple(layer.training for layer in s.layers) for s in stages}
        streams: Randomness | None = (
            Streams(log=draws, flags=flags)
            if schedule.n_workers > 1
            else Recorded()
            if recompute
            else None
        )
        n = len(self.stages)
        offloader = offloader_for(offload and grad and self.training, schedule, self.stages)
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
                record=both_recorders(self.record, timing),
                offload=offloader,
            )
            for stage in self.stages
        ]
        for i, x in enumerate(microbatches):
            self.slots.put(("F", 0, i), x)

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
        self.slots.put(("B", len(self.stages) - 1, i), (torch.scalar_tensor(seed, device=last),))

    def input_grads(self) -> list[Tensor | None]:
        """Gradients of the pipeline's input tensors (after all backward actions ran)."""
        columns = list(zip(*self._each_input_grads()))
        return [None if any(g is None for g in col) else torch.cat(col) for col in columns]  # type: ignore[arg-type]

    def microbatch_input_grads(self) -> list[Tensor | None]:
        """Gradients of each micro-batch's input tensors, micro-batch by micro-batch."""
        return [g for grads in self._each_input_grads() for g in grads]

    def _each_input_grads(self) -> list[Grads]:
        return [self.slots.take(("B", -1, i)) for i in range(self.m)]  # type: ignore[misc]


def both_recorders(first: Recorder | None, second: Recorder | None) -> Recorder | None:
    """One recorder telling both (either may be None)."""
    if first is None or second is None:
        return first or second

    def record(stage: int, i: int, kind: str, start: float, end: float) -> None:
        first(stage, i, kind, start, end)
        second(stage, i, kind, start, end)

    return record


def _no_autocast() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()
