"""What a pipe across ranks hands its compute: itself as a module (for the children it adopts
and the parameters it lists), its grid position, schedule, device and settings, and its guard.

:class:`~pipepar.distributed.pipe.DistributedPipe` builds one after the ranks agreed on the
arguments and its grid exists, and gives it to its compute (:mod:`pipepar.distributed.chain`
for an ``nn.Sequential``, :mod:`pipepar.program.rank_compute` for any model), which so never
names the pipe's class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipepar.core.schedule import Schedule
from pipepar.ranks.guard import Guard
from pipepar.ranks.mesh import Mesh

__all__ = ["PipeContext"]


@dataclass
class PipeContext:
    """A pipe across ranks as its compute sees it.

    Args:
        module: the pipe (an ``nn.Module``): the compute adds this rank's modules to it.
        mesh: the rank's position in the pp x dp grid, its groups and progress.
        schedule: what every rank of the pipeline runs for a full mini-batch (with
            ``recompute="bubbles"``, the compute places it again once the stages are timed).
        device: this rank's device.
        chunks: micro-batches per mini-batch.
        checkpoint: which micro-batches recompute (``"always"``, ``"except_last"``, ``"never"``).
        recompute: where they recompute (``"in_place"`` or ``"bubbles"``:
            :mod:`pipepar.core.recompute_placement`).
        dp: replicas of the pipeline.
        dp_shard: whether the replicas hold shards of the weights.
        guard: runs a call that talks to peers so that one rank's failure ends every rank.
        offload: whether saved activations go to host memory between F and B
            (:mod:`pipepar.core.offload_plan`).
        asked: the schedule as asked, before its recomputes were placed (None: ``schedule``).
    """

    module: nn.Module
    mesh: Mesh
    schedule: Schedule
    device: torch.device
    chunks: int
    checkpoint: str
    dp: int
    dp_shard: bool
    guard: Guard
    recompute: str = "in_place"
    offload: bool = False
    asked: Schedule | None = None

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs, in stage order."""
        return self.schedule.stages_of(self.mesh.stage)

    def adopt(self, name: str, child: nn.Module) -> None:
        """Make the model's child ``name`` the pipe's, so that its keys are the model's.

        A child may bear the name of something the pipe's class defines (timm's ConvNeXt
        keeps its blocks in ``stages``, which the pipe reads as the stage indices of the
        rank): ``add_module`` refuses such a name, so the child is entered among the
        pipe's modules directly. The class's attribute stays what ``pipe.<name>`` reads,
        as in one process; the child is in ``named_children()``, ``parameters()`` and
        ``state_dict()`` under its own name, and ``pipe.module.<name>`` reads it.
        """
        if hasattr(type(self.module), name):
            self.module._modules[name] = child
        else:
            self.module.add_module(name, child)
