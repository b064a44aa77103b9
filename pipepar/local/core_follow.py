"""A micro-batch's driver thread runs on the core of the thread that gives it its turn (Linux).

A driver computes only while the worker that advanced it waits (:mod:`pipepar.program.driver`):
the two never run at once. Left to the operating system, the woken driver often lands on
another core than the worker's, one that another stage's worker (or, across ranks, another
rank) is computing on, and takes its time from it while the worker's core idles. Measured on 2
cores (transformers' GPT-2, two stages, zb-v, one math thread each; ``python
benchmarks/bench_models.py``), pinning each driver to its worker's core at every hand-over took
one process from 0.65 of the same-run limit to 0.80.

Only a driver computing with one math thread is pinned: the threads torch's parallel regions
start inherit their creator's cores, so a driver with several must keep all it may use.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import torch

__all__ = ["CoreFollower"]


def _current_cpu() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu``, where the platform has it and can pin threads."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu  # type: ignore[no-any-return]


_GETCPU = _current_cpu()


class CoreFollower:
    """Keeps one thread (the driver's, :meth:`started` there) on the core of whichever
    thread calls :meth:`follow` (the worker handing it the turn)."""

    def __init__(self) -> None:
        self._tid: int | None = None
        self._cpu = -1

    def started(self) -> None:
        """On the thread to pin: it may be pinned from now on, if it computes with one math
        thread."""
        if _GETCPU is not None and torch.get_num_threads() == 1:
            self._tid = threading.get_native_id()

    def follow(self) -> None:
        """On the calling thread: pin the followed thread to the core this one runs on (a
        system call only when that core changed)."""
        tid = self._tid
        if tid is None or _GETCPU is None:
            return
        cpu = _GETCPU()
        if cpu == self._cpu or cpu < 0:
            return
        try:
            os.sched_setaffinity(tid, (cpu,))
        except OSError:  # ended, or outside the cores it may use: stop following
            self._tid = None
            return
        self._cpu = cpu
