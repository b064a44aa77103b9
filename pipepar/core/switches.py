"""The ``PIPEPAR_*`` environment switches, all read here.

Every switch has a default that is right for training; each one exists to compare, debug or
work around a platform:

=========================  =======  ==============================================================
variable                   default  what it does
=========================  =======  ==============================================================
``PIPEPAR_DEBUG``          off      ``1``: the ``pipepar`` logger prints DEBUG records (every
                                    send and receive across ranks) and one process's workers
                                    check every transfer and wait (slower)
``PIPEPAR_EARLY_WEIGHTS``  on       ``0``: weight-gradient actions of any model's pipe run in
                                    the schedule's order, never early in an idle slot
``PIPEPAR_SHARED_MEMORY``  on       ``0``: ranks on one host send through gloo, not through
                                    rings in ``/dev/shm``
``PIPEPAR_PIN_WORKERS``    on       ``0``: one process's CPU workers are not bound to cores
``PIPEPAR_TUNE_MALLOC``    on       ``0``: glibc's malloc thresholds are left as they are
``PIPEPAR_RUN_ON``         auto     ``workers``: one process's actions always run on its worker
                                    threads; ``caller``: always on the calling thread, one
                                    after another; ``auto``: on CPU, whichever the first calls
                                    timed faster (:mod:`pipepar.local.thread_choice`)
=========================  =======  ==============================================================

Example:
    >>> import os
    >>> os.environ["PIPEPAR_EARLY_WEIGHTS"] = "0"
    >>> early_weights()
    False
    >>> del os.environ["PIPEPAR_EARLY_WEIGHTS"]
"""

from __future__ import annotations

import os

__all__ = [
    "RUN_ON",
    "debug",
    "early_weights",
    "pin_workers",
    "run_on",
    "shared_memory",
    "tune_malloc",
]

RUN_ON = ("auto", "workers", "caller")
"""The values of ``PIPEPAR_RUN_ON``."""

_ON = ("1", "true", "yes")


def _off(name: str) -> bool:
    """Whether a switch that is on by default was turned off (``0``)."""
    return os.environ.get(name, "1") == "0"


def debug() -> bool:
    """``PIPEPAR_DEBUG`` is ``1`` (or ``true``, ``yes``)."""
    return os.environ.get("PIPEPAR_DEBUG", "").lower() in _ON


def early_weights() -> bool:
    """Weight-gradient actions may run early (``PIPEPAR_EARLY_WEIGHTS`` is not ``0``)."""
    return not _off("PIPEPAR_EARLY_WEIGHTS")


def shared_memory() -> bool:
    """Same-host ranks may use shared-memory rings (``PIPEPAR_SHARED_MEMORY`` is not ``0``)."""
    return not _off("PIPEPAR_SHARED_MEMORY")


def pin_workers() -> bool:
    """CPU workers may be bound to cores (``PIPEPAR_PIN_WORKERS`` is not ``0``)."""
    return not _off("PIPEPAR_PIN_WORKERS")


def tune_malloc() -> bool:
    """glibc's malloc thresholds may be tuned (``PIPEPAR_TUNE_MALLOC`` is not ``0``)."""
    return not _off("PIPEPAR_TUNE_MALLOC")


def run_on() -> str:
    """Who runs one process's actions (``PIPEPAR_RUN_ON``): ``"auto"`` (the default),
    ``"workers"`` or ``"caller"``.

    Raises:
        ValueError: the variable is set to another value.
    """
    value = os.environ.get("PIPEPAR_RUN_ON", "auto").strip().lower() or "auto"
    if value not in RUN_ON:
        raise ValueError(
            f"PIPEPAR_RUN_ON must be one of {', '.join(RUN_ON)}, but it is "
            f"{os.environ['PIPEPAR_RUN_ON']!r}; unset it to let the pipe choose"
        )
    return value
