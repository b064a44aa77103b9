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

import torch
from torch import nn

__all__ = [
    "MODES",
    "batch_norms",
    "is_recomputing",
    "recomputing",
    "recomputing_as_before",
    "should_checkpoint",
]

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


@contextmanager
def recomputing_as_before(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Mark this thread as recomputing; the layers' batch norms run exactly as in the first
    forward (torch's checkpoint checks that the recompute saves the same tensors) and their
    running statistics are put back afterwards, so they count the micro-batch once."""
    norms = batch_norms(layers)
    saved = [[b.clone() for b in _statistics(bn)] for bn in norms]
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = False
        for bn, values in zip(norms, saved):
            for buffer, value in zip(_statistics(bn), values):
                # through .data: the batch-norm kernel updates them without a version bump,
                # and a bump would fail the backward of a micro-batch that saved them
                buffer.data.copy_(value)


def _statistics(bn: nn.modules.batchnorm._BatchNorm) -> list[torch.Tensor]:
    return [b for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked) if b is not None]
