"""Whether one layout of a search fits, and its plan: a named schedule's, with or without
activation offload, or the order ``"auto"`` builds; every schedule, plan and built order kept,
as the search asks for each more than once.

A (shape, schedule, ``M``, recompute) fits where :func:`pipepar.plan`'s balance (the split
with the smallest bottleneck among those that fit, from
:class:`~pipepar.planner.stage_memory.MemoryModel`) exists within each device's capacity.

Activation offload is one more choice per layout: one that does not fit is tried again with
offload, its memory from :class:`~pipepar.planner.stage_memory.MemoryModel` with
``offload=True``; one that fits is not (offload only adds copies).

``"auto"`` is the order built for the capacity each device has left
(:mod:`~pipepar.planner.auto_fit`), worth building only on a pipeline of two devices or more
where none of the named V schedules fits the (``pp``, ``M``, recompute) without offload: the
budget search costs up to seconds, and where a named V fits it does as well. It is never
offloaded.

Schedules are built once per (``pp``, schedule, ``M``) and shared by the recompute policies
and the shapes; plans are kept per (shape, schedule, ``M``, recompute, offload).

    >>> fits = Fits()
    >>> found = fits.fit(shape, "zb-v", 8, "never", offloads=[False, True])
    >>> if found is not None:
    ...     plan, offload = found
    ...     order = fits.order(shape, plan)  # the action lists the plan is of
"""

from __future__ import annotations

from typing import Any

from pipepar.core.memory_budget import AUTO
from pipepar.core.named_schedules import VIRTUAL
from pipepar.core.schedule import Schedule
from pipepar.planner.auto_fit import fit_auto
from pipepar.planner.layout_shape import Shape
from pipepar.planner.peak_moments import schedule_for
from pipepar.planner.plan import Plan, fit
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["V_SCHEDULES", "Fits", "per_device"]

V_SCHEDULES = ("zb-v", "v-half", "v-min")
"""The named schedules of two stages per device in a V: ``"auto"`` is built where none fits."""


def per_device(name: str) -> int:
    """Stages per device of schedule ``name`` (``"auto"`` builds a V or a loop of two)."""
    return 2 if name in VIRTUAL or name == AUTO else 1


class Fits:
    """The plans of the layouts a search tries, each computed once."""

    def __init__(self, ranks: str | None = None) -> None:
        self.ranks = ranks  # the runtime across ranks whose posted receives count, or None
        self.schedules: dict[tuple[str, int, int], Schedule] = {}  # (name, pp, M)
        self.plans: dict[tuple[Any, ...], Plan | None] = {}  # fits, by shape, order, recompute
        self.built: dict[tuple[Any, ...], Schedule] = {}  # "auto"'s orders, by shape, M, ...

    def schedule(self, name: str, pp: int, m: int) -> Schedule:
        """The named schedule ``name`` on ``pp`` devices with ``m`` micro-batches."""
        key = (name, pp, m)
        if key not in self.schedules:
            self.schedules[key] = schedule_for(name, pp, m)
        return self.schedules[key]

    def fit(
        self, shape: Shape, name: str, m: int, checkpoint: str, offloads: list[bool]
    ) -> tuple[Plan, bool] | None:
        """The plan of named schedule ``name`` at ``m`` micro-batches that fits, and whether it
        offloads: without offload where it fits so (offload only adds copies), else with it
        (of ``offloads``); None if neither."""
        order = self.schedule(name, shape.pp, m)
        for offload in offloads:
            found = self.plan(shape, order, checkpoint, offload)
            if found is not None:
                return found, offload
        return None

    def plan(self, shape: Shape, order: Schedule, checkpoint: str, offload: bool) -> Plan | None:
        """The plan of ``order`` that fits, or None; kept, as ``"auto"`` asks the V's again."""
        key = (shape.pp, shape.dp, shape.shard, order.name, order.n_microbatches, checkpoint,
               offload)  # fmt: skip
        if key not in self.plans:
            memory = MemoryModel(
                shape.profile,
                order,
                checkpoint=checkpoint,
                foreach=[t.foreach for t in shape.targets],
                offload=offload,
                ranks=self.ranks,
            )
            self.plans[key] = fit(shape.profile, memory, shape.targets)
        return self.plans[key]

    def auto_worth_building(self, shape: Shape, m: int, checkpoint: str) -> bool:
        """Whether ``"auto"`` may gain anything at ``m`` micro-batches: on two devices or more
        (one runs its stages in turn) where no named V fits without offload (where one fits,
        it does as well as the costly budget search)."""
        return shape.pp >= 2 and not any(
            self.plan(shape, self.schedule(v, shape.pp, m), checkpoint, False) is not None
            for v in V_SCHEDULES
        )

    def fit_auto(
        self, shape: Shape, m: int, checkpoint: str, offloads: list[bool]
    ) -> tuple[Plan, bool] | None:
        """The plan of the order built for what each device has left (:mod:`~pipepar.
        planner.auto_fit`), and False (it does not offload); None if it does not fit or
        offload alone is asked for."""
        if False not in offloads:
            return None
        found = fit_auto(shape.profile, shape.targets, chunks=m, checkpoint=checkpoint,
                         ranks=self.ranks)  # fmt: skip
        if found is None:
            return None
        plan, order = found
        self.built[(shape.pp, shape.dp, shape.shard, m, checkpoint)] = order
        return plan, False

    def order(self, shape: Shape, found: Plan) -> Schedule:
        """The action lists ``found`` (a plan of ``shape`` this object made) is of: the order
        built for it for ``"auto"``, else its named schedule."""
        if found.schedule == AUTO:
            return self.built[(shape.pp, shape.dp, shape.shard, found.chunks, found.checkpoint)]
        return self.schedules[(found.schedule, shape.pp, found.chunks)]
