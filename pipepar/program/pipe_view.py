"""What the helpers of :class:`~pipepar.program.pipe.ModelPipe` use of it, as a Protocol.

:mod:`pipepar.program.autograd` and :mod:`pipepar.program.generation` are called by the pipe
with itself; naming the class there would be an import circle (pipe -> autograd -> pipe), so
they name this instead, which the pipe satisfies without knowing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from pipepar.local.worker import WorkerPool

__all__ = ["ModelPipeView"]


class ModelPipeView(Protocol):
    """A :class:`~pipepar.program.pipe.ModelPipe` as its autograd node and ``generate`` see it."""

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        ...

    def _workers(self) -> WorkerPool | None:
        """The worker threads of the pipe's devices, or None for one device."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's call, run through the pipe."""
        ...
