"""What a pipe's compute runs on: the stages, the worker threads, each batch's schedule; and
how ``wrap``'s arguments make them (the schedule, the math threads).

:class:`~pipepar.pipe.Pipe` runs its micro-batches through a *compute*
(:class:`~pipepar.local.chain.ChainCompute` for an ``nn.Sequential``,
:class:`~pipepar.program.compute.ProgramCompute` for any other model). The compute, the
autograd node of a model's call and ``generate`` are handed a :class:`PipeView`, which the pipe
owns: it holds what the pipe built for them (its stages on their devices, the worker threads,
the record of which stages draw random numbers) and reads the pipe's settings as they are now
(``chunks``, ``checkpoint``, ``tracer``, ``training``...), through :class:`PipeSettings`, the
pipe's public face.

A named schedule is built once for one micro-batch (its layout: stages per device) and again,
cached, for each batch's micro-batch count; a :class:`~pipepar.core.schedule.Schedule` object
is taken as it is.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from pipepar.core import switches
from pipepar.core.action_times import ActionTimes
from pipepar.core.devices import DeviceSpec
from pipepar.core.named_schedules import NAMES, VIRTUAL, make, n_workers
from pipepar.core.parameter_hooks import hooks_set_aside
from pipepar.core.randomness import DrawLog
from pipepar.core.recompute_placement import placed_for
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import Recorder
from pipepar.local.executor import FORWARD
from pipepar.local.thread_choice import choice_for, under_callers_mode
from pipepar.local.worker import WorkerPool, math_threads

if TYPE_CHECKING:
    from pipepar.local.carrier import Phase
    from pipepar.local.executor import ThreadRun
    from pipepar.recording.tracer import Tracer

__all__ = [
    "PipeSettings",
    "PipeView",
    "check_threads",
    "count_workers",
    "schedule_for",
    "schedule_of_batch",
]


class PipeSettings(Protocol):
    """The public attributes of a pipe its compute reads (they may change between calls)."""

    chunks: int
    checkpoint: str
    offload: bool
    recompute: str
    threads: list[int]
    tracer: Tracer | None
    training: bool

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's call, run through the pipe."""
        ...


class PipeView:
    """A pipe as its compute sees it.

    Args:
        pipe: the pipe (its settings are read from it at each use).
        stages: the stages on their devices, in order.
        asked: the schedule asked for (a name's is built for one micro-batch; it places the
            stages on the workers); each batch's is rebuilt for its count.
        workers: each worker's device.
    """

    def __init__(
        self, pipe: PipeSettings, stages: list[Stage], asked: Schedule, workers: list[torch.device]
    ) -> None:
        # Weakly: the pipe owns its view, and a cycle would keep the pipe, and its worker
        # threads, alive until the cycle collector ran.
        self._pipe = weakref.ref(pipe)
        # What a backward needs of the pipe, kept: a call's output may outlive its pipe.
        self._model = pipe.module
        self._threads = max(pipe.threads)
        self.stages = stages
        self.asked = asked
        self.draws = DrawLog()  # which stages draw random numbers, across mini-batches
        self._worker_devices = workers
        self._pool: WorkerPool | None = None
        # Whether the workers or the calling thread run each kind of run (timed on the CPU).
        self.thread_choice = choice_for(workers, switches.run_on())
        # What the stages took in a training mini-batch: the costs recomputes are placed on.
        self.times = ActionTimes(len(stages))
        # By (schedule, recompute, checkpoint, measured costs): the schedule and the one each
        # batch runs.
        self._placed: dict[tuple[int, str, str, bool], tuple[Schedule, Schedule]] = {}

    # -- the pipe's settings, as they are now -------------------------------------------------
    @property
    def pipe(self) -> PipeSettings:
        """The pipe this view is of."""
        pipe = self._pipe()
        if pipe is None:
            raise RuntimeError("pipepar: the pipe of this view has been garbage-collected")
        return pipe

    @property
    def chunks(self) -> int:
        return self.pipe.chunks

    @property
    def checkpoint(self) -> str:
        return self.pipe.checkpoint

    @property
    def offload(self) -> bool:
        return self.pipe.offload

    @property
    def threads(self) -> list[int]:
        return self.pipe.threads

    @property
    def tracer(self) -> Tracer | None:
        return self.pipe.tracer

    @property
    def training(self) -> bool:
        return self.pipe.training

    @property
    def module(self) -> nn.Module:
        return self.pipe.module

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device."""
        return [s.device for s in self.stages]

    # -- what runs a batch ----------------------------------------------------------------------
    def schedule(self, m: int) -> Schedule:
        """The schedule of a batch of ``m`` micro-batches, its recomputes placed as the pipe's
        ``recompute`` says (:mod:`pipepar.core.recompute_placement`)."""
        pipe = self.pipe
        base = schedule_of_batch(self.asked, m, pipe.chunks)
        measured = pipe.recompute == "bubbles" and self.times.settled
        key = (id(base), pipe.recompute, pipe.checkpoint, measured)
        found = self._placed.get(key)
        if found is None or found[0] is not base:
            cost = self.times.cost() if measured else None
            placed = placed_for(base, pipe.recompute, pipe.checkpoint, cost=cost)
            found = self._placed[key] = (base, placed)
        return found[1]

    def timing(self) -> Recorder | None:
        """What records the stages' times for placing recomputes (until they are known), if
        the pipe places them (``recompute="bubbles"``)."""
        if self.pipe.recompute != "bubbles" or self.times.settled:
            return None
        return self.times.record

    def workers(self, *, backward: bool = False) -> WorkerPool | None:
        """The worker threads, or None to run on the caller's thread: with one worker, and for
        backward work on CUDA. The backward of ``pipe(...)`` runs on the autograd engine's
        thread of the output's device; a worker's backward on that device would queue behind
        it and wait forever. Kernels are asynchronous, so devices still overlap."""
        cuda = backward and any(d.type == "cuda" for d in self.devices)
        if len(self._worker_devices) == 1 or cuda:
            return None
        if self._pool is None:
            self._pool = WorkerPool(self._worker_devices, threads=self.pipe.threads)
        return self._pool

    def execute(self, run: ThreadRun, phase: Phase, *, backward: bool = False) -> None:
        """Run the actions of ``run`` that ``phase`` selects: on the worker threads, or on the
        calling thread where that was timed faster for this kind of run
        (:mod:`pipepar.local.thread_choice`), under a mode of the caller's, or where
        :meth:`workers` says so. Hooks on the parameters wait while backward actions run:
        autograd calls them once, on the sums the pipe's node hands it
        (:mod:`pipepar.core.parameter_hooks`)."""
        aside = hooks_set_aside(self._model.parameters()) if phase is not FORWARD else None
        with aside or contextlib.nullcontext():
            self._execute(run, phase, backward=backward)

    def _execute(self, run: ThreadRun, phase: Phase, *, backward: bool) -> None:
        pool = self.workers(backward=backward)
        if pool is None:
            run.execute(None, phase)
            return
        if under_callers_mode():  # the workers would run outside the caller's mode
            with math_threads(self._math_threads()):
                run.execute(None, phase)
            return
        choice = self.thread_choice
        kind = run.kind(phase)
        caller = choice.on_caller(kind)
        start = time.perf_counter()
        if caller:  # with the workers' math threads: each kernel computes as on a worker
            with math_threads(self._math_threads()):
                run.execute(None, phase)
        else:
            run.execute(pool, phase)
        choice.took(kind, caller, time.perf_counter() - start)

    def _math_threads(self) -> int:
        """The workers' count of math threads, as the pipe says now (as it said last, once the
        pipe is gone: a call's output may outlive its pipe until its backward)."""
        pipe = self._pipe()
        if pipe is not None:
            self._threads = max(pipe.threads)
        return self._threads

    def close(self) -> None:
        """Stop the worker threads (started again on the next call)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads do not pickle: a copy starts its own
        state["_pipe"] = self.pipe  # a copy of the pipe copies it (set back to a weak one)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pipe = state.pop("_pipe")
        self.__dict__.update(state)
        self._pipe = weakref.ref(pipe)


# -- from wrap's arguments ----------------------------------------------------------------------
@lru_cache(maxsize=64)
def _cached(name: str, n_stages: int, m: int, n_workers: int) -> Schedule:
    return make(name, n_stages, m, n_workers=n_workers)


def schedule_of_batch(layout: Schedule, m: int, chunks: int) -> Schedule:
    """The schedule of a batch that splits into ``m`` micro-batches: a named schedule is built
    for ``m`` (a short batch gives fewer than ``chunks``); a Schedule object must fit ``m``."""
    if layout.name not in NAMES or layout.n_microbatches == m:
        if layout.n_microbatches != m:
            raise ValueError(
                f"the batch gives {m} micro-batches but the schedule was built for "
                f"{layout.n_microbatches}; pass at least chunks={chunks} rows (or "
                f"{layout.n_microbatches} microbatches=), or a schedule by name (built for "
                "each batch's count)"
            )
        return layout
    return _cached(layout.name, layout.n_stages, m, layout.n_workers)


def schedule_for(schedule: object, n_stages: int, chunks: int, n_workers: int) -> Schedule:
    """The pipe's schedule from ``wrap(schedule=...)``: a name (built for one
    micro-batch, rebuilt per batch by :func:`schedule_of_batch`) or a Schedule object."""
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(
            f"schedule must be a name or a pipepar Schedule, but got {type(schedule).__name__}; "
            "pass e.g. schedule='1f1b'"
        )
    if isinstance(schedule, str) and schedule in NAMES:
        return _cached(schedule, n_stages, 1, n_workers)
    return make(schedule, n_stages, chunks, n_workers=n_workers)


def count_workers(schedule: object, balance: Sequence[int], devices: DeviceSpec) -> int:
    """Devices the stages run on: the schedule's count (one per stage, or one per two stages
    for the virtual-stage schedules), or for those the devices given."""
    if isinstance(schedule, str) and schedule in VIRTUAL:
        if isinstance(devices, int) and not isinstance(devices, bool):
            return devices
        if isinstance(devices, Sequence) and not isinstance(devices, str):
            return len(devices)
    return n_workers(schedule, len(balance))


def check_threads(threads: int | None, devices: list[torch.device], chunks: int) -> list[int]:
    """Math threads per worker: ``threads``, or the cores shared among the CPU workers that
    compute at once on average, ``K * M / (M + K - 1)`` under GPipe, rounded (K CPU workers, M
    micro-batches): with ``chunks=1`` the workers take turns and each gets every core."""
    if threads is not None and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise ValueError(
            f"threads must be a positive int or None, but got {threads!r}; e.g. threads=1"
        )
    k = sum(d.type == "cpu" for d in devices)
    at_once = max(1, round(k * chunks / (chunks + k - 1))) if k else 1
    share = threads or max(1, torch.get_num_threads() // at_once)
    return [share if d.type == "cpu" else 1 for d in devices]
