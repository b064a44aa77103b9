"""What a pipe's computes and helpers read of it, as a Protocol.

:class:`~pipepar.pipe.Pipe` runs its micro-batches through a *compute*
(:class:`~pipepar.local.chain.ChainCompute` for an ``nn.Sequential``,
:class:`~pipepar.program.compute.ProgramCompute` for any other model), which the pipe calls
with itself; the autograd node of a model's call and ``generate`` get the pipe too. Naming the
class there would be an import circle (pipe -> compute -> pipe), so they name this instead,
which the pipe satisfies without knowing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from pipepar.core.randomness import DrawLog
    from pipepar.core.schedule import Schedule
    from pipepar.core.stage import Stage
    from pipepar.local.worker import WorkerPool
    from pipepar.recording.tracer import Tracer

__all__ = ["PipeView"]


class PipeView(Protocol):
    """A :class:`~pipepar.pipe.Pipe` as its compute, autograd nodes and ``generate`` see
    it: the settings and stages it was built with, and its worker threads."""

    chunks: int
    checkpoint: str
    threads: list[int]
    tracer: Tracer | None
    training: bool
    _stages: list[Stage]
    _draws: DrawLog

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        ...

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device."""
        ...

    def _schedule(self, m: int) -> Schedule:
        """The schedule of a batch of ``m`` micro-batches."""
        ...

    def _workers(self, *, backward: bool = False) -> WorkerPool | None:
        """The worker threads of the pipe's devices, or None to run on the caller's thread."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's call, run through the pipe."""
        ...
