"""A layout: how a model runs on a set of devices, as :func:`pipepar.search_layouts` ranks them.

Pipeline degree ``pp`` (devices per pipeline), data-parallel degree ``dp`` (replicas of it),
whether each stage's state is sharded over the replicas (``dp_shard``), schedule,
micro-batches, recompute, activation offload and balance, with the predicted step and
memory. It is data:
the search makes it, :mod:`pipepar.render.layout_table` draws a ranking of them, and its
:attr:`Layout.plan` is the plan of one replica that ``pipepar.report`` shows.

    >>> best = pipepar.search_layouts(prof, devices=64, batch=512, cluster="h100x8")[0]
    >>> print(best)
    >>> print(pipepar.report.table(best.plan))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipepar.core.schedule import Schedule
from pipepar.core.units import format_bytes
from pipepar.planner.plan import Plan
from pipepar.planner.step_time import StepPrediction

__all__ = ["Layout", "layouts_json"]

UNITS = {
    "*_bytes": "B",
    "*_ms": "ms",
    "throughput": "rows of the global batch per second",
    "bubble": "fraction of the workers' time idle over the predicted pipeline span",
    "rows": "rows per replica and step",
}
"""The units of :func:`layouts_json`'s fields (its ``"units"`` entry)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run the model on the devices, with its predicted step and memory.

    Example:
        >>> best = layouts[0]
        >>> best.pp * best.dp == 64 and max(best.peak_bytes) <= best.capacity_bytes
        True
    """

    pp: int
    """Devices per pipeline (its workers); a virtual-stage schedule runs ``2 pp`` stages."""
    dp: int
    """Data-parallel replicas of the pipeline; ``pp * dp`` devices in all."""
    schedule: str
    """The schedule's name."""
    chunks: int
    """Micro-batches M per replica and step."""
    checkpoint: str
    """Recompute: ``"never"``, ``"except_last"`` or ``"always"``."""
    balance: tuple[int, ...]
    """Layers per stage."""
    rows: int
    """Rows each replica takes per step (the global batch / ``dp``)."""
    step_ms: float
    """The predicted step."""
    throughput: float
    """Rows of the global batch per second: ``rows * dp / step``."""
    peak_bytes: tuple[int, ...]
    """Predicted peak of each device of a pipeline (every replica's are the same)."""
    capacity_bytes: int
    """Each device's capacity."""
    prediction: StepPrediction
    """The step prediction: parts per stage, bubble, exposed all-reduce."""
    plan: Plan
    """The plan of one replica (its profile scaled to :attr:`rows`), carrying
    :attr:`prediction`; ``pipepar.report.table(layout.plan)`` shows it. With
    :attr:`dp_shard`, its memory is one rank's of its shard group (``plan.profile.shard``)."""
    dp_shard: bool = False
    """Each stage's parameters, gradients and optimizer state sharded over its ``dp``
    replicas (``pipepar.distributed.wrap(..., dp=dp, dp_shard=True)``): weights all-gathered
    for the step, gradients reduce-scattered; False: replicated (all-reduced)."""
    offload: bool = False
    """Activation offload (``pipepar.wrap(..., offload=True)``): what each micro-batch's
    forward saves goes to host memory until shortly before its backward. Its memory and its
    copies are in :attr:`peak_bytes` and :attr:`step_ms`."""
    order: Schedule | None = None
    """For :attr:`schedule` ``"auto"``: the order built for this layout's split and the
    capacity its devices have left (:mod:`pipepar.planner.auto_fit`), whose action lists
    :attr:`prediction` and :attr:`peak_bytes` are of; a pipe built from the layout runs it.
    None for a named schedule (built from its name)."""

    @property
    def pipe_schedule(self) -> str | Schedule:
        """What a pipe built from this layout takes as ``schedule=``: the built
        :attr:`order`, else the schedule's name."""
        return self.order if self.order is not None else self.schedule

    @property
    def bubble(self) -> float:
        """Idle fraction of the workers over the predicted pipeline span."""
        return self.prediction.bubble

    def to_dict(self) -> dict[str, Any]:
        """The layout as plain data, sizes in bytes and times in ms (the plan itself:
        ``layout.plan.to_dict()``)."""
        return {
            "pp": self.pp,
            "dp": self.dp,
            "dp_shard": self.dp_shard,
            "offload": self.offload,
            "schedule": self.schedule,
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "balance": list(self.balance),
            "rows": self.rows,
            "micro_batch_rows": self.plan.micro_batch_rows,
            "step_ms": self.step_ms,
            "throughput": self.throughput,
            "bubble": self.bubble,
            "exposed_allreduce_ms": self.prediction.exposed_allreduce_ms,
            "gather_ms": max(self.prediction.gather_ms, default=0.0),
            "peak_bytes": list(self.peak_bytes),
            "capacity_bytes": self.capacity_bytes,
        }

    def __str__(self) -> str:
        shard = " sharded" if self.dp_shard else ""
        offload = " offload" if self.offload else ""
        return (
            f"pp={self.pp} dp={self.dp}{shard} {self.schedule} M={self.chunks} "
            f"recompute={self.checkpoint}{offload}: {self.step_ms / 1e3:.3g} s/step, "
            f"{self.throughput:.3g} rows/s, bubble {self.bubble:.0%}, peak "
            f"{format_bytes(max(self.peak_bytes))} of {format_bytes(self.capacity_bytes)}"
        )


def layouts_json(layouts: Sequence[Layout], *, indent: int | None = 2) -> str:
    """Layouts as JSON: each one's summary, fastest first, and the whole plan of the first.

    Example:
        >>> json.loads(layouts_json(layouts))["layouts"][0]["pp"] == layouts[0].pp
        True
    """
    data = {
        "format": "pipepar.layouts",
        "version": 1,
        "units": dict(UNITS),
        "layouts": [x.to_dict() for x in layouts],
        "plan": layouts[0].plan.to_dict() if layouts else None,
    }
    return json.dumps(data, indent=indent)
