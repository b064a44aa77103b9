"""What a pipe's compute runs on: the stages, the worker threads, each batch's schedule.

:class:`~pipepar.pipe.Pipe` runs its micro-batches through a *compute*
(:class:`~pipepar.local.chain.ChainCompute` for an ``nn.Sequential``,
:class:`~pipepar.program.compute.ProgramCompute` for any other model). The compute, the
autograd node of a model's call and ``generate`` are handed a :class:`PipeView`, which the pipe
owns: it holds what the pipe built for them (its stages on their devices, the worker threads,
the record of which stages draw random numbers) and reads the pipe's settings as they are now
(``chunks``, ``checkpoint``, ``tracer``, ``training``...), through :class:`PipeSettings`, the
pipe's public face.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from pipepar.core.randomness import DrawLog
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.local.pipe_args import schedule_of_batch
from pipepar.local.worker import WorkerPool

if TYPE_CHECKING:
    from pipepar.recording.tracer import Tracer

__all__ = ["PipeSettings", "PipeView"]


class PipeSettings(Protocol):
    """The public attributes of a pipe its compute reads (they may change between calls)."""

    chunks: int
    checkpoint: str
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
        self.pipe = pipe
        self.stages = stages
        self.asked = asked
        self.draws = DrawLog()  # which stages draw random numbers, across mini-batches
        self._worker_devices = workers
        self._pool: WorkerPool | None = None

    # -- the pipe's settings, as they are now -------------------------------------------------
    @property
    def chunks(self) -> int:
        return self.pipe.chunks

    @property
    def checkpoint(self) -> str:
        return self.pipe.checkpoint

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
        """The schedule of a batch of ``m`` micro-batches."""
        return schedule_of_batch(self.asked, m, self.pipe.chunks)

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

    def close(self) -> None:
        """Stop the worker threads (started again on the next call)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads do not pickle: a copy starts its own
        return state
