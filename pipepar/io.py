"""``pipepar.io``: the public name of :mod:`pipepar.persist.files` (atomic saves and loads)."""

from pipepar.persist.files import *  # noqa: F403
from pipepar.persist.files import __all__  # noqa: F401
