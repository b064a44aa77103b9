"""``pipepar.timeline``: the public name of :mod:`pipepar.render.timeline` (drawing a timeline)."""

from pipepar.render.timeline import *  # noqa: F403
from pipepar.render.timeline import __all__  # noqa: F401
