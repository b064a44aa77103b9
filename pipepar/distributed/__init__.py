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

import importlib
from typing import TYPE_CHECKING, Any

from pipepar.distributed.pipe import SCHEDULES, DistributedPipe
from pipepar.distributed.wrapping import wrap
from pipepar.ranks.cores import bind_cores
from pipepar.ranks.failure import PipelineError

if TYPE_CHECKING:
    from pipepar.distributed.snapshot import load_checkpoint, save_checkpoint

_CHECKPOINTS = ("load_checkpoint", "save_checkpoint")
"""Loaded on first use, with torch.distributed.checkpoint (and DTensor, FSDP2): seconds of
every rank's start that a run saving no sharded checkpoint need not pay."""


def __getattr__(name: str) -> Any:
    """``save_checkpoint`` and ``load_checkpoint``, from :mod:`pipepar.distributed.snapshot`."""
    if name not in _CHECKPOINTS:
        raise AttributeError(f"module 'pipepar.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module("pipepar.distributed.snapshot"), name)
    globals()[name] = value
    return value

__all__ = [
    "SCHEDULES",
    "DistributedPipe",
    "PipelineError",
    "bind_cores",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]
