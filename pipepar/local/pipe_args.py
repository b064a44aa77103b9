"""A pipe's schedule and math threads from ``wrap``'s arguments
(:class:`~pipepar.pipe.Pipe`).

A named schedule is built once for one micro-batch (its layout: stages per device) and again,
cached, for each batch's micro-batch count; a :class:`~pipepar.core.schedule.Schedule` object
is taken as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from pipepar.core.devices import DeviceSpec
from pipepar.core.named_schedules import NAMES, VIRTUAL, make, n_workers
from pipepar.core.schedule import Schedule

__all__ = ["check_threads", "count_workers", "schedule_for", "schedule_of_batch"]


@lru_cache(maxsize=64)
def _cached(name: str, n_stages: int, m: int, n_workers: int) -> Schedule:
    return make(name, n_stages, m, n_workers=n_workers)


def schedule_of_batch(layout: Schedule, m: int, chunks: int) -> Schedule:
    """The schedule of a batch that splits into ``m`` micro-batches: a named schedule is built
    for ``m`` (a short batch gives fewer than ``chunks``); a Schedule object must fit ``m``."""
    if layout.name not in NAMES or layout.n_microbatches == m:
        if layout.n_microbatches != m:
            raise ValueError(
                f"the batch gives {m} micro-batches but the schedule was built for "
                f"{layout.n_microbatches}; pass at least chunks={chunks} rows (or "
                f"{layout.n_microbatches} microbatches=), or a schedule by name (built for "
                "each batch's count)"
            )
        return layout
    return _cached(layout.name, layout.n_stages, m, layout.n_workers)


def schedule_for(schedule: object, n_stages: int, chunks: int, n_workers: int) -> Schedule:
    """The pipe's schedule from ``wrap(schedule=...)``: a name (built for one
    micro-batch, rebuilt per batch by :func:`schedule_of_batch`) or a Schedule object."""
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(
            f"schedule must be a name or a pipepar Schedule, but got {type(schedule).__name__}; "
            "pass e.g. schedule='1f1b'"
        )
    if isinstance(schedule, str) and schedule in NAMES:
        return _cached(schedule, n_stages, 1, n_workers)
    return make(schedule, n_stages, chunks, n_workers=n_workers)


def count_workers(schedule: object, balance: Sequence[int], devices: DeviceSpec) -> int:
    """Devices the stages run on: the schedule's count (one per stage, or one per two stages
    for the virtual-stage schedules), or for those the devices given."""
    if isinstance(schedule, str) and schedule in VIRTUAL:
        if isinstance(devices, int) and not isinstance(devices, bool):
            return devices
        if isinstance(devices, Sequence) and not isinstance(devices, str):
            return len(devices)
    return n_workers(schedule, len(balance))


def check_threads(threads: int | None, devices: list[torch.device], chunks: int) -> list[int]:
    """Math threads per worker: ``threads``, or the cores shared among the CPU workers that
    compute at once on average, ``K * M / (M + K - 1)`` under GPipe, rounded (K CPU workers, M
    micro-batches): with ``chunks=1`` the workers take turns and each gets every core."""
    if threads is not None and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise ValueError(
            f"threads must be a positive int or None, but got {threads!r}; e.g. threads=1"
        )
    k = sum(d.type == "cpu" for d in devices)
    at_once = max(1, round(k * chunks / (chunks + k - 1))) if k else 1
    share = threads or max(1, torch.get_num_threads() // at_once)
    return [share if d.type == "cpu" else 1 for d in devices]
