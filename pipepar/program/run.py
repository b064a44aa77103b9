"""One mini-batch of a model cut while it runs: the threads' run of
:mod:`pipepar.local.executor` (:class:`~pipepar.local.executor.ThreadRun`) with
:class:`~pipepar.program.step.SegmentStep` stages.

The workers walk the same schedules; what travels between stages is found by the cut, so the
hand-off points carry only the order (an empty value), and the outputs are whatever the model's
forward returned for each micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor, nn

from pipepar.batching.calls import Parts
from pipepar.core.offload_plan import offloader_for
from pipepar.core.randomness import DrawLog, Randomness, Streams
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import Recorder
from pipepar.local.executor import Phase, ThreadRun, both_recorders
from pipepar.local.weights import shared_stages
from pipepar.local.worker import WorkerPool
from pipepar.program.step import Batch, SegmentContext, SegmentStep
from pipepar.recording.tracer import Tracer

__all__ = ["ProgramRun"]


class ProgramRun(ThreadRun):
    """The steps of one mini-batch whose forward code runs on the drivers of ``batch``.

    Args:
        stages: the pipe's stages.
        params: per stage, the parameters it holds.
        schedule: what each worker runs.
        batch: makes the micro-batches' drivers and ledgers, given what the drivers enter while
            they compute a stage (the stage's step's context).
        drivers: the threads the drivers run on (one per micro-batch).
        inputs: per micro-batch, the pipe's tensor arguments (in the caller's flat order).
        rows: each micro-batch's rows.
        grad: whether a backward follows.
        tracer: where to record a timeline, if any.
        draws: the pipe's record of which stages draw random numbers (see
            :class:`~pipepar.core.randomness.DrawLog`).
        checkpoint: which micro-batches the stages recompute (``"always"``,
            ``"except_last"``, ``"never"``; :mod:`pipepar.program.recompute`).
        aliases: per stage, its ``(weight, alias)`` pairs (:mod:`pipepar.program.aliases`).
        offload: whether saved activations go to host memory between F and B
            (:mod:`pipepar.core.offload_plan`).
        timing: also told about each computation (the stages' times, on which the pipe
            places recomputes), if given.

    An idle worker runs a runnable W early, its own or, on a shared CPU, the other worker's,
    as a chain's run does (:mod:`pipepar.local.weights`): a W reads
    only its micro-batch's graph and its stage's sums, nothing of the drivers. Two stages of
    one micro-batch may then finish their backward at once, on two workers; the ledger's
    releases take turns.
    """

    steps: list[SegmentStep]

    def __init__(
        self,
        stages: Sequence[Stage],
        params: Sequence[list[nn.Parameter]],
        schedule: Schedule,
        batch: Callable[[SegmentContext], Batch],
        drivers: ThreadPoolExecutor,
        inputs: Sequence[Sequence[Tensor]],
        parts: Parts,
        *,
        grad: bool,
        tracer: Tracer | None = None,
        draws: DrawLog | None = None,
        checkpoint: str = "never",
        aliases: Sequence[Sequence[tuple[nn.Parameter, Tensor]]] | None = None,
        offload: bool = False,
        timing: Recorder | None = None,
    ) -> None:
        self.batch = batch(_context_of(weakref.ref(self)))
        m = len(self.batch.drivers)
        super().__init__(stages, schedule, m, shared_stages(schedule), tracer)
        self.inputs, self.parts = inputs, parts
        # Several workers race for the generator: a stream per (stage, micro-batch) keeps runs
        # repeatable. One worker draws in order (a recompute replays the default generators).
        flags = {s.index: tuple(u.training for u in s.layers) for s in stages}
        streams: Randomness | None = (
            Streams(log=draws, flags=flags) if schedule.n_workers > 1 else None
        )
        offloader = offloader_for(offload and grad and self.training, schedule, self.stages)
        self.steps = [
            SegmentStep(
                stage,
                m,
                batch=self.batch,
                params=params[stage.index],
                aliases=aliases[stage.index] if aliases is not None else (),
                checkpoint=checkpoint,
                grad=grad,
                input_grad=True,
                streams=streams,
                split=functools.partial(schedule.splits_backward, stage.index),
                rebuilds=functools.partial(schedule.rebuilds, stage.index),
                record=both_recorders(self.record, timing),
                offload=offloader,
            )
            for stage in self.stages
        ]
        for i in range(m):  # the cut carries the values: the slots only the order
            self.slots.put(("F", 0, i), ())
        self._pool = drivers
        self._started = False
        self._lock = threading.Lock()

    def _segment_context(self, stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
        """What micro-batch ``i``'s driver enters while it computes ``stage``: that stage's
        step's context (the steps exist before any driver runs)."""
        return self.steps[stage].segment_context(stage, i)

    def execute(self, pool: WorkerPool | None, phase: Phase) -> None:
        self._start()
        try:
            super().execute(pool, phase)
        except BaseException:
            self.batch.abort()
            raise

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                for driver in self.batch.drivers:
                    self._pool.submit(driver.run)

    # -- what goes in and out -----------------------------------------------------------------
    def results(self) -> list[Any]:
        """What the model's forward (or the head) returned for each micro-batch."""
        return [d.result for d in self.batch.drivers]

    def outputs(self) -> list[Any]:
        return self.results()

    def seed(self, i: int, tensor: Tensor, grad: Tensor) -> None:
        """Start backward from ``tensor`` (part of micro-batch ``i``'s output) with ``grad``."""
        ledger = self.batch.ledgers[i]
        stage = ledger.stage_of(tensor)
        if stage is None or not tensor.requires_grad:
            return
        ledger.outputs.append((stage, tensor))
        ledger.add_grad(tensor, grad)

    def open_backward(self) -> None:
        """Let the last stage's backward actions start (the gradients are in the ledgers)."""
        for i in range(self.m):
            self.slots.put(("B", len(self.stages) - 1, i), ())

    def input_grads(self) -> list[Tensor | None]:
        """Gradients of the pipe's tensor arguments, micro-batch by micro-batch, in the order
        of :attr:`inputs` (``None`` where none reached them)."""
        return [
            self.batch.ledgers[i].grads.get(id(t)) if t.requires_grad else None
            for i, xs in enumerate(self.inputs)
            for t in xs
        ]

    microbatch_input_grads = input_grads  # the calls' own tensors: micro-batch by one

    def take_param_grads(self) -> list[Tensor | None]:
        """Per-parameter sums, stage by stage, the tied uses added to their holder's."""
        steps = self.steps
        where = {id(p): (j, k) for j, s in enumerate(steps) for k, p in enumerate(s.held)}
        sums = [list(s.param_grads()) for s in steps]
        for step in steps:
            for param, g in step.tied:
                j, k = where[id(param)]
                g = g.to(param.device)
                sums[j][k] = g if sums[j][k] is None else sums[j][k] + g  # type: ignore[operator]
        for step in steps:
            step.release()
        for ledger in self.batch.ledgers:
            ledger.forget()
        return [g for row in sums for g in row]


def _context_of(run: weakref.ref[ProgramRun]) -> SegmentContext:
    """The run's :meth:`ProgramRun._segment_context`, without the batch holding the run (the
    run holds the batch: a cycle would keep every graph of the mini-batch until the cycle
    collector ran)."""

    def context(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
        alive = run()
        if alive is None:
            raise RuntimeError("pipepar: the mini-batch's run has ended")
        return alive._segment_context(stage, i)

    return context
