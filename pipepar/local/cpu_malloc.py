"""Keep glibc from returning gradient-sized buffers to the kernel between micro-batches.

Every micro-batch's backward allocates fresh weight gradients (a 1024 x 1024 ``Linear`` makes a
4 MiB one) and frees them once they are summed. glibc adapts its thresholds to this only
gradually and, while it does, hands such blocks back to the kernel (``munmap`` or trimming the
top of an arena) and takes them again on the next micro-batch. Each round trip page-faults the
whole buffer again (up to 4,000 faults per micro-batch measured), and with several CPU stages
in one process the stage threads also queue on the process's memory-map lock: on a 2-core
machine this cost ~10% of a K=2, M=8 step (``benchmarks/RESULTS.md``, "Analysis").

:func:`tune` fixes glibc's thresholds at the ceiling its own adaptive rule would reach (blocks up
to 32 MiB come from the arenas, an arena keeps up to 64 MiB free at its top) and grows the heap
64 MiB at a time (a pipeline's activations in flight otherwise grow and trim it every step),
once per process.
A pipe calls it before the first training step its engine runs with a CPU stage (a one-stage
pipe that runs plain autograd, with nothing to recompute or trace, does not). It does nothing
when:

- the C library is not glibc (musl, macOS, Windows);
- the user chose malloc settings already (``MALLOC_*_`` variables or ``glibc.malloc`` tunables);
- another allocator is preloaded (jemalloc, tcmalloc, mimalloc);
- ``PIPEPAR_TUNE_MALLOC=0`` is set.

The cost is memory the process keeps for reuse instead of returning it: at most 64 MiB per
malloc arena (about one arena per thread that allocates).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from pipepar.core import switches

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "tune"]

_log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets when it raises the threshold itself
TOP_PAD = 2 * MMAP_THRESHOLD  # extra heap taken on each growth, so it is not grown page by page
_M_TRIM_THRESHOLD = -1  # from <malloc.h>
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_lock = threading.Lock()
_outcome: bool | None = None


def tune() -> bool:
    """Apply the thresholds once per process; return whether they are in effect."""
    global _outcome
    if _outcome is not None:  # every training step asks: answer without the lock
        return _outcome
    with _lock:
        if _outcome is None:
            reason = _reason_to_skip()
            _outcome = reason is None and _apply()
            if reason is not None:
                _log.debug("malloc thresholds left as they are: %s", reason)
        return _outcome


def _reason_to_skip() -> str | None:
    env = os.environ
    if not switches.tune_malloc():
        return "PIPEPAR_TUNE_MALLOC=0"
    if not _glibc():
        return "the C library is not glibc"
    chosen = [name for name in _USER_SETTINGS if name in env]
    if chosen or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return f"the user set {chosen or 'GLIBC_TUNABLES'}"
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in _OTHER_ALLOCATORS):
        return f"another allocator is preloaded ({preload})"
    return None


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):
        return False


def _apply() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mmap first: setting either value turns glibc's adaptive rule off.
    applied = (
        bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        and bool(mallopt(_M_TOP_PAD, TOP_PAD))
    )
    if applied:
        _log.info(
            "malloc: blocks up to %d MiB from the arenas, trim above %d MiB (PIPEPAR_TUNE_MALLOC=0 "
            "keeps glibc's defaults)",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    return applied
