"""pipepar: pipeline parallelism for PyTorch.

Split any model (transformers, timm, torchvision or an ``nn.Sequential``) into stages across
devices (one process) or ranks (torchrun), run micro-batches through them concurrently, and
plan the split from a memory profile.

    >>> import pipepar
    >>> pipe = pipepar.wrap(model, balance=[3, 3, 2], devices=["cpu", "cpu", "cpu"], chunks=8)
    >>> loss_fn(pipe(x), y).backward()
"""

import importlib
from typing import TYPE_CHECKING, Any

from pipepar import io
from pipepar.batching.rules import Documents, Packed
from pipepar.core.losses import LossNotJoinable
from pipepar.core.reductions import BatchCoupled
from pipepar.core.schedule import Schedule
from pipepar.core.sequential import sequentialize
from pipepar.gpipe import GPipe, from_torchgpipe_state_dict
from pipepar.pipe import Pipe
from pipepar.recording.tracer import Timeline, tracing
from pipepar.version import installed_version
from pipepar.wrapping import wrap

if TYPE_CHECKING:
    from pipepar import report, timeline
    from pipepar.planner.layout import Layout
    from pipepar.planner.layout_search import search_layouts
    from pipepar.planner.model_profile import profile
    from pipepar.planner.partition import partition
    from pipepar.planner.plan import Plan, StagePlan, plan
    from pipepar.planner.profile import LayerProfile, Profile
    from pipepar.program.units import Unit, units

_LOADED_ON_USE = {
    "report": "pipepar.report",
    "timeline": "pipepar.timeline",
    "Layout": "pipepar.planner.layout",
    "search_layouts": "pipepar.planner.layout_search",
    "profile": "pipepar.planner.model_profile",
    "partition": "pipepar.planner.partition",
    "Plan": "pipepar.planner.plan",
    "StagePlan": "pipepar.planner.plan",
    "plan": "pipepar.planner.plan",
    "LayerProfile": "pipepar.planner.profile",
    "Profile": "pipepar.planner.profile",
    "Unit": "pipepar.program.units",
    "units": "pipepar.program.units",
}
"""Public names whose modules load on first use: the planner, the reports and the units of
any model. A pipe of an ``nn.Sequential`` then loads neither the planner nor the code that
cuts any model's forward (about half of pipepar's modules)."""


def __getattr__(name: str) -> Any:
    """A name of :data:`_LOADED_ON_USE`, from its module (once; then it is a global)."""
    where = _LOADED_ON_USE.get(name)
    if where is None:
        raise AttributeError(f"module 'pipepar' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"pipepar.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LOADED_ON_USE})


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
