"""Pipelines across processes: a stage per rank (two with the virtual-stage schedules), ``dp``
replicas, launched by torchrun.

    >>> import pipepar.distributed as ppd
    >>> pipe = ppd.wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
    >>> loss = pipe.step(x, y, loss_fn)  # doctest: +SKIP

Modules: :mod:`~pipepar.distributed.wrapping` (``wrap``: an ``nn.Sequential`` or any model),
:mod:`~pipepar.distributed.pipe` (``DistributedPipe``, the one pipe across ranks),
:mod:`~pipepar.distributed.chain` (how it runs an ``nn.Sequential``: a chain of layers),
:mod:`~pipepar.distributed.stage` (materializing the local layers) and
:mod:`~pipepar.distributed.snapshot` (training checkpoints: a directory each rank writes its
part of through ``torch.distributed.checkpoint``, or one file). How it runs any other model is
:mod:`pipepar.program.rank_compute`; what both computes share is in :mod:`pipepar.ranks`: the
pp x dp grid, transport, the agreement on the arguments at wrap time, the rank executor, dp
sync, failures, progress and the guard; :func:`bind_cores` keeps each rank of a CPU host on
cores of its own.
"""

from pipepar.distributed.pipe import SCHEDULES, DistributedPipe
from pipepar.distributed.snapshot import load_checkpoint, save_checkpoint
from pipepar.distributed.wrapping import wrap
from pipepar.ranks.cores import bind_cores
from pipepar.ranks.failure import PipelineError

__all__ = [
    "SCHEDULES",
    "DistributedPipe",
    "PipelineError",
    "bind_cores",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]
