"""What a mini-batch run a second time must start from: the first run's random states and
batch-norm running statistics (a call that left its learned route, :mod:`pipepar.program.route`,
runs again under the cut's mode, and its results must be those of one run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipepar.core.recompute import batch_norms

__all__ = ["Rerun", "Start"]


class Start:
    """The random states and running statistics at the start of a mini-batch."""

    def __init__(self, devices: Sequence[torch.device], norms: Sequence[nn.Module]) -> None:
        self.random = [(torch.device("cpu"), torch.get_rng_state())]
        self.random += [(d, torch.cuda.get_rng_state(d)) for d in devices]
        self.running = [
            (b, b.clone()) for bn in norms if bn.training for b in bn.buffers(recurse=False)
        ]

    def restore(self) -> None:
        """Put the random states and running statistics back as they were."""
        for device, state in self.random:
            if device.type == "cpu":
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state, device)
        for buffer, value in self.running:
            buffer.copy_(value)


class Rerun:
    """Takes a :class:`Start` of ``model``'s mini-batches: the CPU's random state, each CUDA
    device's of ``devices``, and the batch norms' statistics (found once, here)."""

    def __init__(self, model: nn.Module, devices: Sequence[torch.device]) -> None:
        self._cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self._norms = batch_norms([model])

    def start(self) -> Start:
        return Start(self._cuda, self._norms)


