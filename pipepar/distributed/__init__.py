"""Pipelines across processes: a stage per rank (two with the virtual-stage schedules), ``dp``
replicas, launched by torchrun.

    >>> import pipepar.distributed as ppd
    >>> pipe = ppd.wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
    >>> loss = pipe.step(x, y, loss_fn)  # doctest: +SKIP

Modules: :mod:`~pipepar.distributed.mesh` (the pp x dp grid of ranks),
:mod:`~pipepar.distributed.stage` (materializing the local layers),
:mod:`~pipepar.distributed.transport` (point-to-point activations and gradients),
:mod:`~pipepar.distributed.runtime` (running a schedule), :mod:`~pipepar.distributed.replicas`
(dp sync), :mod:`~pipepar.distributed.arguments` (one rank's arguments checked alone),
:mod:`~pipepar.distributed.handshake` (ranks agree on the arguments at wrap time),
:mod:`~pipepar.distributed.failure` (fault reporting), :mod:`~pipepar.distributed.progress`
(what each rank runs and waits for; every wait bounded by ``timeout``),
:mod:`~pipepar.distributed.guard` (a step's failure or stall ends every rank) and
:mod:`~pipepar.distributed.snapshot` (training checkpoints).
"""

from pipepar.distributed.failure import PipelineError
from pipepar.distributed.pipe import SCHEDULES, DistributedPipe, wrap
from pipepar.distributed.snapshot import load_checkpoint, save_checkpoint

__all__ = [
    "SCHEDULES",
    "DistributedPipe",
    "PipelineError",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]
