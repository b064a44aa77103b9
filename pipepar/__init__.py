"""pipepar: pipeline parallelism for PyTorch.

Split any model (transformers, timm, torchvision or an ``nn.Sequential``) into stages across
devices (one process) or ranks (torchrun), run micro-batches through them concurrently, and
plan the split from a memory profile.

    >>> import pipepar
    >>> pipe = pipepar.wrap(model, balance=[3, 3, 2], devices=["cpu", "cpu", "cpu"], chunks=8)
    >>> loss_fn(pipe(x), y).backward()
"""

from pipepar import io, report, timeline
from pipepar.core.losses import LossNotJoinable
from pipepar.core.reductions import BatchCoupled
from pipepar.core.schedule import Schedule
from pipepar.core.sequential import sequentialize
from pipepar.gpipe import GPipe, from_torchgpipe_state_dict
from pipepar.pipe import Pipe
from pipepar.planner.layout import Layout
from pipepar.planner.layout_search import search_layouts
from pipepar.planner.model_profile import profile
from pipepar.planner.partition import partition
from pipepar.planner.plan import Plan, StagePlan, plan
from pipepar.planner.profile import LayerProfile, Profile
from pipepar.program.batch_rules import Documents, Packed
from pipepar.program.units import Unit, units
from pipepar.tracing.tracer import Timeline, tracing
from pipepar.version import installed_version
from pipepar.wrapping import wrap

ModelPipe = Pipe
"""The pipe of any model: the same class as :class:`Pipe` (one pipe for every model), kept
under the name it had when models other than ``nn.Sequential`` had a class of their own; an
alias, not part of ``__all__``."""

__version__ = installed_version()
"""The installed distribution's version (``pip show pipepar``); see :mod:`pipepar.version`."""

__all__ = [
    "BatchCoupled",
    "Documents",
    "GPipe",
    "LayerProfile",
    "Layout",
    "LossNotJoinable",
    "Packed",
    "Pipe",
    "Plan",
    "Profile",
    "Schedule",
    "from_torchgpipe_state_dict",
    "io",
    "StagePlan",
    "Timeline",
    "partition",
    "plan",
    "profile",
    "report",
    "search_layouts",
    "sequentialize",
    "timeline",
    "tracing",
    "Unit",
    "units",
    "wrap",
]
