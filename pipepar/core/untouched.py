"""A look at a model that leaves it as it was: planning and finding its units run its forward.

Planning (:func:`pipepar.profile`, the layout search of ``pipepar.wrap(sample=...)``) and
:func:`pipepar.units` run the model's own forward on the sample. That run must change nothing a
later step sees: a training-mode batch norm would move its running statistics and count a batch
in ``num_batches_tracked``, and a dropout would advance the random generators, so the first
training step would differ from the plain model's. :func:`untouched` puts the generators and the
model's buffers back as they were, whatever the forward did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["untouched"]


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Run the block, then put back the random generators' states (the CPU's and every
    initialized CUDA device's) and every buffer of ``model`` (running statistics, counters).

    Example:
        >>> bn = nn.BatchNorm1d(3)
        >>> with untouched(bn):
        ...     _ = bn(torch.randn(4, 3))
        >>> int(bn.num_batches_tracked)
        0
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
