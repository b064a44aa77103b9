"""pipepar's logger: ``logging.getLogger("pipepar")``, the parent of every module's logger.

Each module logs through a child named after it (``logging.getLogger(__name__)``), so that
configuring the ``pipepar`` logger (its level, its handlers) configures them all. With
``PIPEPAR_DEBUG=1`` (:mod:`pipepar.core.switches`) the ``pipepar`` logger prints its DEBUG
records (every hand-off between stages, every message between ranks) even where the program
configured no logging.
"""

from __future__ import annotations

import logging

from pipepar.core import switches

__all__ = ["LOGGER", "debug_enabled"]

LOGGER = logging.getLogger("pipepar")


def debug_enabled() -> bool:
    """True when ``PIPEPAR_DEBUG=1``; then the ``pipepar`` logger prints DEBUG records (a
    handler is added if it has none, and its level lowered to DEBUG if it was higher)."""
    if not switches.debug():
        return False
    if not LOGGER.handlers:  # opted in by env: make the trace visible without logging config
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        LOGGER.addHandler(handler)
    if LOGGER.level == logging.NOTSET or LOGGER.level > logging.DEBUG:
        LOGGER.setLevel(logging.DEBUG)
    return True
