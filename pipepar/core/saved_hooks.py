"""The caller's saved-tensor hooks, entered again wherever a stage computes.

``torch.autograd.graph.saved_tensors_hooks`` (and what builds on it, as ``save_on_cpu``) says
what a forward keeps for its backward: a pair of functions applied to each tensor it saves,
e.g. one that keeps it in a lower precision. Like autocast, the pair is thread-local: a stage's
forward on the calling thread (:mod:`pipepar.local.thread_choice`) saw the caller's, one on a
worker thread saw none, and the two computed different gradients. A step takes the caller's
innermost pair when it is made and enters it around each forward, so every thread saves what
the plain model under the same hooks saves. Hooks of pipepar's own entered inside (the
offload's) still come first, as an inner pair does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SavedHooks"]


@dataclass(frozen=True)
class SavedHooks:
    """The caller's innermost ``(pack, unpack)`` pair, or None where it has none.

    Example:
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ...     hooks = SavedHooks.capture()
        >>> bool(hooks), bool(SavedHooks.capture())
        (True, False)
    """

    pair: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None

    @classmethod
    def capture(cls) -> SavedHooks:
        """The pair the calling thread saves tensors with now (as ``torch.utils.checkpoint``
        reads it)."""
        return cls(torch._C._autograd._top_saved_tensors_default_hooks(False))

    def __bool__(self) -> bool:
        return self.pair is not None

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        """The pair, entered (nothing without one)."""
        if self.pair is None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(*self.pair)
