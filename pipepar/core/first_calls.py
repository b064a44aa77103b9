"""A chain's stages watched for code that mixes the rows of a batch, on each first call.

The cut of a model's own forward watches micro-batch 0 of every first call of a kind with its
probe (:mod:`pipepar.core.reductions`). A chain of layers (an ``nn.Sequential``) is run stage
by stage on the workers, so each stage watches its own: the first time a stage is given an
input of a new kind, with more than one micro-batch in the mini-batch, its layers run under a
probe that follows the rows (the input's first dimension, the chain's contract) and refuses an
operation that mixes them (:class:`~pipepar.core.reductions.BatchCoupled`). A kind is marked
as watched only once its probe ran through: a refused one is refused again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from typing import Any

from torch import Tensor, nn

from pipepar.core.batch_dims import accepting
from pipepar.core.microbatch import Value, tensors
from pipepar.core.reductions import Probe

__all__ = ["FirstCalls"]


class FirstCalls:
    """Which kinds of input each stage of a chain has been watched on.

    Args:
        model: the chain (its layer paths name what a message is about).
        batch_coupling, deferred_batch_norm: which operations mixing rows are accepted (see
            :func:`~pipepar.core.batch_dims.accepting`).
    """

    def __init__(self, model: nn.Module, batch_coupling: str, deferred_batch_norm: bool) -> None:
        self._model, self._settings = model, (batch_coupling, deferred_batch_norm)
        self._accepts = accepting(batch_coupling, deferred_batch_norm)
        self._watched: set[Hashable] = set()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (FirstCalls, (self._model, *self._settings))  # watched again after a copy

    def watching(self, stage: int, x: Value, m: int) -> contextlib.AbstractContextManager[Any]:
        """What stage ``stage`` runs micro-batch input ``x`` of a mini-batch of ``m`` under: a
        probe the first time it sees such an input, when micro-batching could change anything."""
        rows = [t for t in tensors(x) if t.dim() > 0]
        if m < 2 or not rows or rows[0].shape[0] < 2:
            return contextlib.nullcontext()
        kind = (stage, tuple((tuple(t.shape), t.dtype) for t in rows))
        with self._lock:
            if kind in self._watched:
                return contextlib.nullcontext()
        return self._probing(kind, rows, stage)

    @contextlib.contextmanager
    def _probing(self, kind: Hashable, rows: list[Tensor], stage: int) -> Iterator[None]:
        names = {id(m): f"layer {path}" for path, m in self._model.named_modules() if path}
        probe = Probe(
            rows, rows=rows[0].shape[0], names=names, where=f"stage {stage}",
            accepts=self._accepts,
        )  # fmt: skip
        with probe:
            yield
        probe.release()
        with self._lock:
            self._watched.add(kind)
