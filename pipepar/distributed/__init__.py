"""Pipelines across processes: a stage per rank (two with the virtual-stage schedules), ``dp``
replicas, launched by torchrun.

    >>> import pipepar.distributed as ppd
    >>> pipe = ppd.wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
    >>> loss = pipe.step(x, y, loss_fn)  # doctest: +SKIP

Modules: :mod:`~pipepar.distributed.wrapping` (``wrap``: an ``nn.Sequential`` or any model),
:mod:`~pipepar.distributed.pipe` (the ``nn.Sequential`` pipe),
:mod:`~pipepar.distributed.stage` (materializing the local layers) and
:mod:`~pipepar.distributed.snapshot` (training checkpoints: a directory each rank writes its
part of through ``torch.distributed.checkpoint``, or one file). What both pipes across ranks
share (this and :mod:`pipepar.program.rank_pipe`) is in :mod:`pipepar.ranks`: the pp x dp grid,
transport, the agreement on the arguments at wrap time, the rank executor, dp sync, failures,
progress and the guard.
"""

from pipepar.distributed.pipe import SCHEDULES, DistributedPipe
from pipepar.distributed.snapshot import load_checkpoint, save_checkpoint
from pipepar.distributed.wrapping import wrap
from pipepar.ranks.failure import PipelineError

__all__ = [
    "SCHEDULES",
    "DistributedPipe",
    "PipelineError",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]
