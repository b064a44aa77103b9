"""Activation checkpointing per micro-batch: drop activations in forward, recompute in backward.

The recomputed forward must see the same random numbers as the first one (so dropout masks
match). The CPU generator is process-wide and stage workers are threads, so a stage that draws
random numbers holds :data:`RNG_LOCK` while it runs a forward or a recompute: its saved state is
then exactly the state its layers consumed. Stages without random layers never take the lock and
run fully in parallel.

During a recompute, batch-norm layers must not update their running statistics a second time;
:func:`recomputing` switches that off and marks the thread so deferred batch norm can tell.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MODES",
    "RNG_LOCK",
    "RngState",
    "is_recomputing",
    "private_stream",
    "recomputing",
    "should_checkpoint",
    "uses_randomness",
]

MODES = ("always", "except_last", "never")

#: Held by a stochastic stage while it draws random numbers (forward or recompute).
RNG_LOCK = threading.RLock()

_STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)
_local = threading.local()


def should_checkpoint(mode: str, index: int, m: int) -> bool:
    """Whether micro-batch ``index`` of ``m`` is checkpointed under ``mode``.

    ``except_last`` spares the last micro-batch: its backward starts right after its forward, so
    keeping its activations costs little and saves one recompute.
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return index < m - 1
    return False


def uses_randomness(layers: Iterable[nn.Module]) -> bool:
    """True if any layer (or sub-module) is a known random layer such as ``nn.Dropout``.

    Dropout with ``p=0`` draws nothing, so it does not make a stage random (and take the lock).
    """
    return any(_draws(sub) for layer in layers for sub in layer.modules())


def _draws(module: nn.Module) -> bool:
    return isinstance(module, _STOCHASTIC) and getattr(module, "p", 1.0) != 0


@dataclass
class RngState:
    """The generator states a forward pass started from, to replay it exactly."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """Save the CPU generator and, for a CUDA device, that device's generator."""
        cuda = {}
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            cuda[index] = torch.cuda.get_rng_state(index)
        return cls(torch.get_rng_state(), cuda)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from the saved states, then put the current states back."""
        with torch.random.fork_rng(devices=list(self.cuda), enabled=True):
            torch.set_rng_state(self.cpu)
            for index, state in self.cuda.items():
                torch.cuda.set_rng_state(state, index)
            yield


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextmanager
def private_stream(device: torch.device, seed: int) -> Iterator[None]:
    """Draw the block's random numbers from a stream of its own, then restore the global state.

    Stage workers are threads sharing the process-wide generator: without a stream per
    (stage, micro-batch), which stage draws first, and so every dropout mask, would depend on
    thread timing, and the same seed would not give the same run. Hold :data:`RNG_LOCK`.
    """
    cuda = [_cuda_index(device)] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def is_recomputing() -> bool:
    """True on a thread that is recomputing a checkpointed forward."""
    return getattr(_local, "recomputing", False)


def _batch_norms(layers: Iterable[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
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
    frozen = _batch_norms(layers)
    for bn in frozen:
        bn.track_running_stats = False
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = False
        for bn in frozen:
            bn.track_running_stats = True
