"""Activation checkpointing per micro-batch: which micro-batches recompute, and what changes then.

A checkpointed micro-batch keeps only its stage input in forward and runs the stage again in
backward. The recomputed forward draws the same random numbers as the first one (that is
:mod:`pipepar.core.randomness`'s job). During a recompute, batch-norm layers must not update their
running statistics a second time; :func:`recomputing` switches that off and marks the thread so
deferred batch norm can tell.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["MODES", "batch_norms", "is_recomputing", "recomputing", "should_checkpoint"]

MODES = ("always", "except_last", "never")

_local = threading.local()


def should_checkpoint(mode: str, index: int, m: int) -> bool:
    """Whether micro-batch ``index`` of ``m`` is checkpointed under ``mode``.

    ``except_last`` spares the last micro-batch: its backward starts right after its forward, so
    keeping its activations costs little and saves one recompute.

    Example:
        >>> [should_checkpoint("except_last", i, 3) for i in range(3)]
        [True, True, False]
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return index < m - 1
    return False


def is_recomputing() -> bool:
    """True on a thread that is recomputing a checkpointed forward."""
    return getattr(_local, "recomputing", False)


def batch_norms(layers: Iterable[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch-norm layers in ``layers`` (at any depth) that keep running statistics."""
    return [
        sub
        for layer in layers
        for sub in layer.modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats
    ]


@contextmanager
def recomputing(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Mark this thread as recomputing and freeze the layers' batch-norm running statistics.

    A batch-norm layer with ``track_running_stats=False`` normalizes with the batch statistics in
    training mode, exactly as the first forward did, but leaves its buffers alone.
    """
    frozen = batch_norms(layers)
    for bn in frozen:
        bn.track_running_stats = False
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = False
        for bn in frozen:
            bn.track_running_stats = True
