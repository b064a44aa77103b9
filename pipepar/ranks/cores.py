"""Bind a rank to its share of the host's cores (Linux).

Several ranks on one host each run more threads than their math: the pipe's per-micro-batch
driver threads, the transport's threads. Left to the operating system, a thread woken by
another of its rank lands on whichever core is free enough, often one running another rank,
and takes its time from that rank. :func:`bind_cores` keeps each rank's threads on cores of
its own, as launchers do for CPU training (the cores the process may use are split into equal
runs, one per rank of the host).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = ["bind_cores", "share"]

_ALLOWED: tuple[int, ...] | None = None
"""The cores the process could use before its first binding (a second call splits these
again rather than the share the first one left)."""


def bind_cores(local_rank: int | None = None, local_world_size: int | None = None) -> list[int]:
    """Bind this process, every thread it has and every thread it starts later, to its share
    of the cores it may use; cap torch's math threads at that many. Call it early on each
    rank of a CPU job (before or after ``init_process_group``).

    The cores are split into ``local_world_size`` equal runs, in order, and local rank ``k``
    takes the ``k``-th (with fewer cores than ranks, ranks share cores evenly). The cores
    the process may use are read once (``taskset`` around the whole job is respected), and
    calling again binds from the same set. Leave it out where the launcher already gives each
    rank cores of its own (SLURM's ``--cpu-bind``): it would split them again.

    Args:
        local_rank: this rank's index among the ranks of its host; default: ``LOCAL_RANK``
            (set by torchrun).
        local_world_size: how many ranks the host runs; default: ``LOCAL_WORLD_SIZE``
            (set by torchrun).

    Returns:
        The cores this process now runs on.

    Raises:
        ValueError: a count is missing or out of range.
        RuntimeError: the platform cannot bind threads to cores (Linux only).

    Example::

        import pipepar.distributed as ppd
        ppd.bind_cores()  # under torchrun --nproc-per-node N, on a CPU host
    """
    k = _given(local_rank, "local_rank", "LOCAL_RANK")
    n = _given(local_world_size, "local_world_size", "LOCAL_WORLD_SIZE")
    if n < 1 or not 0 <= k < n:
        raise ValueError(
            f"bind_cores: local_rank={k} must be in [0, local_world_size={n}); pass this "
            "rank's index among its host's ranks and how many ranks the host runs"
        )
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(
            "bind_cores: this platform cannot bind threads to cores (Linux only); leave the "
            "call out here"
        )
    cores = share(_allowed(), k, n)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # ended meanwhile, or not ours to bind
            continue
    os.sched_setaffinity(0, cores)  # this thread, also where /proc/self/task cannot be read
    if torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))
    return sorted(os.sched_getaffinity(0))


def share(cores: Sequence[int], k: int, n: int) -> list[int]:
    """The ``k``-th of ``n`` equal runs of ``cores`` (never empty: with fewer cores than
    runs, run ``k`` gets core ``cores[k * len(cores) // n]``).

    >>> share([0, 1, 2, 3], 1, 2), share([0, 1, 2], 2, 3), share([0, 1], 3, 4)
    ([2, 3], [2], [1])
    """
    if not cores:
        raise ValueError("share: no cores to split")
    c = len(cores)
    run = list(cores[k * c // n : (k + 1) * c // n])
    return run or [cores[k * c // n]]


def _given(value: int | None, name: str, env: str) -> int:
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None:
        raise ValueError(
            f"bind_cores: {name} is not given and {env} is not set (torchrun sets it); pass "
            f"{name}= explicitly"
        )
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"bind_cores: {env}={text!r} is not an integer; pass {name}=") from None


def _allowed() -> tuple[int, ...]:
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
    return _ALLOWED


def _threads() -> list[int]:
    """The ids of this process's threads (Linux's ``/proc/self/task``)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []
