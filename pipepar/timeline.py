"""``pipepar.timeline``: drawing a timeline, the public name of :mod:`pipepar.render.timeline`
(SVG, PNG, Chrome trace) and :mod:`pipepar.render.timeline_files` (:func:`save` by suffix)."""

from pipepar.render.timeline import *  # noqa: F403
from pipepar.render.timeline import __all__ as _drawing
from pipepar.render.timeline_files import SUFFIXES, save

__all__ = [*_drawing, "SUFFIXES", "save"]
