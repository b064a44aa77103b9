"""The planner: choose the balance that fits every device and has the smallest bottleneck.

:func:`plan` takes a :class:`~pipepar.profile.Profile` (or profiles a model on ``meta``),
predicts each candidate stage's peak with :class:`~pipepar.stage_memory.MemoryModel`, and runs an
exact dynamic program over (stage, last layer): with measured times it minimizes the slowest
stage's time among the splits that fit; without times it minimizes the largest stage peak
relative to its device's capacity. The result, a :class:`Plan`, is data: per-stage
breakdowns and JSON; :mod:`pipepar.report` draws it (a terminal table, an HTML page).

    >>> model = models.mlp(depth=8, width=1024)        # 16 layers
    >>> plan = pipepar.plan(model, torch.randn(64, 1024), devices=4, capacity="16GiB", chunks=8)
    >>> plan.balance
    [4, 4, 4, 4]
    >>> print(pipepar.report.table(plan))
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipepar.core.schedule import Schedule
from pipepar.core.units import format_bytes
from pipepar.planner.peak_moments import schedule_for
from pipepar.planner.plan_inputs import (
    as_profile,
    check_choice,
    check_chunks,
    check_cut_points,
    check_profile,
)
from pipepar.planner.plan_search import Candidate, search, unconstrained
from pipepar.planner.plan_targets import Target, resolve_targets
from pipepar.planner.profile import LayerProfile, Profile
from pipepar.planner.sharded_state import sharded
from pipepar.planner.stage_memory import MemoryModel, StageMemory
from pipepar.planner.step_time import StepPrediction

__all__ = ["Plan", "StagePlan", "at_balance", "fit", "plan"]

logger = logging.getLogger(__name__)

CHECKPOINTS = ("always", "except_last", "never")

FORMAT_VERSION = 1
"""The version of :meth:`Plan.to_dict`'s layout (its ``"version"`` entry)."""

UNITS = {
    "*_bytes": "B",
    "*_ms": "ms",
    "bubble": "fraction of the step the pipeline idles, from the schedule with F = B = W",
    "prediction bubble": "fraction of the workers' time idle, from the predicted step",
    "in_flight": "micro-batches",
    "micro_batch_rows": "rows",
    "peak_bytes": "B",
    "layer activation_bytes": "B, for the whole batch",
    "stage activation_bytes": "B, for the micro-batches in flight",
}
"""The units of :meth:`Plan.to_dict`'s fields (its ``"units"`` entry)."""

_MOVED = {
    "report": "pipepar.report.table(plan, width=..., color=...)",
    "save_html": "pipepar.report.save_html(plan, path, timeline=...)",
}


@dataclass(frozen=True)
class StagePlan:
    """One stage of a :class:`Plan`: which layers, where, and the predicted memory and time.

    Attributes:
        index: stage number j.
        device: the device's name (``"cuda:1"``, ``"cpu"``, ``"device 3"``).
        layers: the layer indices of the stage.
        params_bytes / grads_bytes / optimizer_bytes: resident parameter memory.
        activation_bytes: activations the stage holds at its device's peak.
        transient_bytes: temporaries at the peak (layer work space, gradients being made or
            recorded for W, the optimizer step).
        peak_bytes: the stage's part of its device's peak; the sum of the five parts above.
        capacity_bytes: the device's capacity, or None for unlimited.
        in_flight: micro-batches whose activations the stage holds at once (the schedule's).
        phase: when the device's peak happens: "forward", "backward", "backward_end",
            "input_grad" (B of a split backward), "weight" (W) or "optimizer".
        time_ms: measured forward + backward time of the stage's layers (whole batch), or None.
        worker: index of the device running the stage; a virtual-stage schedule puts several
            stages on one device, which share its capacity.
        device_peak_bytes: the device's predicted peak: the sum of its stages' ``peak_bytes``.

    Example:
        >>> plan = pipepar.plan(prof, devices=2, capacity="1GiB", chunks=4)
        >>> [(s.index, s.layers, s.peak_bytes <= s.capacity_bytes) for s in plan.stages]
        [(0, range(0, 2), True), (1, range(2, 4), True)]
    """

    index: int
    device: str
    layers: range
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int
    capacity_bytes: int | None
    in_flight: int
    phase: str
    time_ms: float | None
    worker: int
    device_peak_bytes: int

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity minus the device's peak (negative when it does not fit), or None."""
        if self.capacity_bytes is None:
            return None
        return self.capacity_bytes - self.device_peak_bytes

    @property
    def fits(self) -> bool:
        """Whether the device's predicted peak fits its capacity."""
        return self.capacity_bytes is None or self.device_peak_bytes <= self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "index": self.index,
            "device": self.device,
            "first_layer": self.layers.start,
            "last_layer": self.layers.stop - 1,
            "layers": len(self.layers),
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "transient_bytes": self.transient_bytes,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "headroom_bytes": self.headroom_bytes,
            "in_flight": self.in_flight,
            "peak_phase": self.phase,
            "time_ms": self.time_ms,
            "worker": self.worker,
            "device_peak_bytes": self.device_peak_bytes,
        }


@dataclass(frozen=True)
class Plan:
    """A balance and everything needed to explain it.

    Attributes:
        balance: layers per stage.
        stages: the per-stage predictions.
        profile: the profile it was planned from.
        chunks: micro-batches M.
        schedule: the schedule's name, e.g. "1f1b" or "zb-v".
        checkpoint: "always", "except_last" or "never".
        objective: "time" (measured times, memory as a constraint) or "memory".
        micro_batch_rows: rows per micro-batch, ``ceil(batch / M)``.
        bubble: predicted idle fraction of the pipeline, from the schedule's own timing with
            unit costs (:meth:`pipepar.core.schedule.Schedule.bubble`); (K-1)/(M+K-1) for
            GPipe and 1F1B.
        prediction: the predicted step on a cluster
            (:func:`~pipepar.planner.step_time.predict_step`), when one was made (a layout
            search makes one for every layout); None otherwise.

    Example:
        >>> plan = pipepar.plan(prof, devices=4, capacity="16GiB", chunks=8, schedule="1f1b")
        >>> plan.balance  # doctest: +SKIP
        [3, 3, 3, 2]
        >>> print(pipepar.report.table(plan))  # doctest: +SKIP
        >>> data = plan.to_json()  # the plan as data, with the unit of every field
    """

    balance: list[int]
    stages: list[StagePlan]
    profile: Profile
    chunks: int
    schedule: str
    checkpoint: str
    objective: str
    micro_batch_rows: int
    bubble: float
    prediction: StepPrediction | None = None

    @property
    def layers(self) -> list[LayerProfile]:
        """The profiled layers."""
        return self.profile.layers

    @property
    def peak_bytes(self) -> int:
        """The largest predicted device peak."""
        return max(s.device_peak_bytes for s in self.stages)

    def stage_of(self, layer: int) -> int:
        """The stage holding layer ``layer``."""
        return next(s.index for s in self.stages if layer in s.layers)

    def totals(self) -> dict[str, Any]:
        """Sums over the stages (bytes), the largest device peak and the slowest stage's time."""
        times = [s.time_ms for s in self.stages]
        return {
            "params_bytes": sum(s.params_bytes for s in self.stages),
            "grads_bytes": sum(s.grads_bytes for s in self.stages),
            "optimizer_bytes": sum(s.optimizer_bytes for s in self.stages),
            "activation_bytes": sum(s.activation_bytes for s in self.stages),
            "transient_bytes": sum(s.transient_bytes for s in self.stages),
            "peak_bytes": sum(s.peak_bytes for s in self.stages),
            "max_peak_bytes": self.peak_bytes,
            "max_stage_time_ms": None if None in times else max(times),  # type: ignore[type-var]
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything in the report as JSON-ready data, sizes in bytes and times in ms.

        Example:
            >>> plan.to_dict()["balance"] == plan.balance
            True
        """
        layers = []
        for layer, data in zip(self.layers, self.profile.to_dict()["layers"]):
            data["output_shape"] = list(layer.output_shape)
            data["time_ms"] = layer.time_ms
            data["stage"] = self.stage_of(layer.index)
            layers.append(data)
        return {
            "format": "pipepar.plan",
            "version": FORMAT_VERSION,
            "units": dict(UNITS),
            "config": {
                "devices": [s.device for s in self.stages],
                "capacity_bytes": [s.capacity_bytes for s in self.stages],
                "chunks": self.chunks,
                "schedule": self.schedule,
                "checkpoint": self.checkpoint,
                "optimizer": self.profile.optimizer,
                "shard": self.profile.shard,
                "profile_device": self.profile.device,
                "batch_size": self.profile.batch_size,
                "micro_batch_rows": self.micro_batch_rows,
                "input_shape": list(self.profile.input_shape),
                "objective": self.objective,
            },
            "balance": list(self.balance),
            "bubble": self.bubble,
            "prediction": None if self.prediction is None else _prediction(self.prediction),
            "fits": all(s.fits for s in self.stages),
            "stages": [s.to_dict() | {"fits": s.fits} for s in self.stages],
            "layers": layers,
            "totals": self.totals(),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as JSON, with a ``units`` entry naming the units of every field.

        Example:
            >>> json.loads(plan.to_json())["balance"] == plan.balance
            True
        """
        return json.dumps(self.to_dict(), indent=indent)

    if not TYPE_CHECKING:  # unseen by mypy, which would let any attribute through

        def __getattr__(self, name: str) -> Any:
            where = _MOVED.get(name)
            if where is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            raise AttributeError(
                f"Plan.{name} is gone: a plan is data, the renderers read it; call {where}"
            )

    def __str__(self) -> str:
        peaks = ", ".join(format_bytes(s.peak_bytes) for s in self.stages)
        return f"Plan(balance={self.balance}, peaks=[{peaks}], bubble={self.bubble:.0%})"


def plan(
    model_or_profile: nn.Sequential | Profile,
    sample: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    devices: int | Sequence[str | int | torch.device] | None = 4,
    capacity: int | str | Sequence[int | str | None] | None = None,
    optimizer: object = "adam",
    chunks: int = 8,
    schedule: str | Schedule = "gpipe",
    checkpoint: str = "except_last",
    profile_device: str | torch.device = "meta",
    shard: int = 1,
    ranks: str | None = None,
) -> Plan:
    """Choose how many layers each stage gets so every stage fits and the slowest is fastest.

    Memory per device is parameters + gradients + optimizer state + the activations of the
    micro-batches in flight + temporaries, at the moment of the schedule when their sum peaks
    (:mod:`pipepar.planner.stage_memory`): the schedule object says which micro-batches each
    stage holds then (M under GPipe, K - j under 1F1B, stage inputs only when checkpointed).

    Args:
        model_or_profile: a :class:`~pipepar.profile.Profile`, or an ``nn.Sequential`` to
            profile on ``profile_device`` with ``sample``.
        sample: the input batch, when a model is given.
        devices: the number of devices, or their names (``["cuda:0", "cuda:1"]``); the names
            need not exist here, so a cluster can be planned from a laptop.
        capacity: bytes per device: an int or a string like ``"80GiB"`` for all, one per
            device, or None (a CUDA device's total memory when it exists here, else unlimited).
        optimizer: whose state to count (see :func:`pipepar.profile`); None for none.
        chunks: micro-batches per mini-batch, M.
        schedule: a name of :data:`pipepar.core.named_schedules.NAMES` or a
            :class:`~pipepar.core.schedule.Schedule` for ``len(devices)`` workers and ``chunks``
            micro-batches. The virtual-stage names (``"interleaved-1f1b"``, ``"zb-v"``,
            ``"v-half"``, ``"v-min"``) plan two stages per device (a balance twice as long);
            each stage is planned within half its device's capacity, a safe bound, and the
            device's exact peak is reported.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        profile_device: where to profile a model (``"meta"``: no memory, no times; a real
            device also measures times, and the balance then minimizes time).
        shard: the data-parallel ranks each stage's parameters, gradients and optimizer state
            are split over (``pipepar.distributed.wrap(..., dp=shard, dp_shard=True)``); each
            device is then one rank of its group: the step's gathered weights and gradient
            sums plus its shards (:mod:`pipepar.planner.sharded_state`).
        ranks: the devices are ranks of ``pipepar.distributed`` (``"program"``: any model;
            ``"chain"``: an ``nn.Sequential``): each also holds the receives it posts ahead
            of their messages (:mod:`pipepar.planner.posted_receives`); None: one process.

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: bad arguments, or no split fits; the message names the layer or stage that
            is too big and by how much.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(16384, 16384, device="meta") for _ in range(40)])
        >>> p = pipepar.plan(model, torch.empty(8, 16384, device="meta"), devices=8,
        ...                  capacity="80GiB", optimizer="adam", chunks=8)
        >>> p.balance
        [5, 5, 5, 5, 5, 5, 5, 5]
    """
    check_choice("checkpoint", checkpoint, CHECKPOINTS)
    chunks = check_chunks(chunks)
    prof = as_profile(model_or_profile, sample, optimizer, profile_device)
    prof = sharded(prof, shard) if prof.shard == 1 else prof
    check_profile(prof)
    targets = resolve_targets(devices, capacity, layers=len(prof))
    m = min(chunks, max(prof.batch_size, 1))
    if m < chunks:
        logger.info("chunks=%d > batch of %d rows: planning %d micro-batches", chunks, m, m)
    order = schedule_for(schedule, len(targets), m)  # an unknown name raises, listing NAMES
    if order.n_stages > len(prof):
        most = len(prof) * len(targets) // order.n_stages
        raise ValueError(
            f"schedule {order.name!r} runs {order.n_stages} stages on {len(targets)} devices but "
            f"the model has {len(prof)} layers; use at most {most} devices or a schedule with "
            "one stage per device"
        )
    foreach = [t.foreach for t in targets]
    model = MemoryModel(prof, order, checkpoint=checkpoint, foreach=foreach, ranks=ranks)
    shares = _stage_targets(order, targets)
    check_cut_points(model.startable, len(shares), prof)
    found = fit(prof, model, targets)
    if found is None:
        raise ValueError(_explain(model, shares, prof, order.n_workers))
    return found


def fit(prof: Profile, model: MemoryModel, targets: list[Target]) -> Plan | None:
    """The plan of ``prof`` for the schedule and checkpointing of ``model`` (built from
    ``prof``) over ``targets`` (one per worker), or None when no split fits.

    What :func:`plan` runs once its arguments are checked (``prof`` by :func:`check_profile`);
    a search trying many layouts calls it directly and moves on when nothing fits.
    """
    order = model.schedule
    shares = _stage_targets(order, targets)
    if sum(model.startable) < len(shares):
        return None
    times = [layer.time_ms or 0.0 for layer in prof.layers] if prof.timed else None
    best = search(model, shares, times)
    if best is None:
        return None
    return _plan_of(prof, model, targets, best)


def at_balance(
    prof: Profile, model: MemoryModel, targets: list[Target], balance: Sequence[int]
) -> Plan:
    """The plan of ``prof`` split as ``balance`` (layers per stage) for the schedule and
    checkpointing of ``model``, fitting or not: each stage's figures, ``device_peak_bytes``
    its device's exact peak (a search that builds a schedule for a split checks it so)."""
    best, a = [], 0
    for j, size in enumerate(balance):
        best.append(Candidate(j, range(a, a + size), 0, 0.0))
        a += size
    return _plan_of(prof, model, targets, best)


def _plan_of(
    prof: Profile, model: MemoryModel, targets: list[Target], best: list[Candidate]
) -> Plan:
    order = model.schedule
    times = [layer.time_ms or 0.0 for layer in prof.layers] if prof.timed else None
    return Plan(
        balance=[len(c.layers) for c in best],
        stages=_stage_plans(model, order, targets, best, prof),
        profile=prof,
        chunks=order.n_microbatches,
        schedule=order.name,
        checkpoint=model.checkpoint,
        objective="time" if times is not None else "memory",
        micro_batch_rows=math.ceil(max(prof.batch_size, 1) / order.n_microbatches),
        bubble=order.bubble(),
    )


def _prediction(pred: StepPrediction) -> dict[str, Any]:
    """The predicted step as plain data: its totals, each stage's parts and the simulated
    actions (ms)."""
    names = ("step_ms", "pipeline_ms", "bubble", "exposed_allreduce_ms", "schedule", "chunks")
    out: dict[str, Any] = {name: getattr(pred, name) for name in names}
    out |= {"dp": pred.dp, "cluster": pred.cluster, "source": pred.source}
    out |= {"dp_shard": pred.dp_shard, "gather_ms": list(pred.gather_ms)}
    out["busy_ms"] = list(pred.busy_ms)
    out["stages"] = [
        {f.name: getattr(st, f.name) for f in fields(st) if f.name != "layers"}
        | {"first_layer": st.layers.start, "last_layer": st.layers.stop - 1}
        for st in pred.stages
    ]
    out["actions"] = [a.to_dict() for a in pred.actions]
    return out


def _stage_targets(order: Schedule, targets: list[Target]) -> list[Target]:
    """One target per stage: a device running V stages gives each 1/V of its capacity.

    The search then bounds each stage alone (its own part of every moment of its device);
    the device's peak is at most the sum of those, so a split found this way fits. It is
    exact with one stage per device, and conservative with several.
    """
    out = []
    for s in range(order.n_stages):
        t = targets[order.placement[s]]
        v = len(order.stages_of(order.placement[s]))
        out.append(t if t.capacity is None or v == 1 else replace(t, capacity=t.capacity // v))
    return out


def _stage_plans(
    model: MemoryModel,
    order: Schedule,
    targets: list[Target],
    best: list[Candidate],
    prof: Profile,
) -> list[StagePlan]:
    """Every stage's part of its device's exact peak (all the device's stages together)."""
    parts: dict[int, StageMemory] = {}
    for w in range(order.n_workers):
        mine = order.stages_of(w)
        ranges = [(best[s].layers.start, best[s].layers.stop - 1) for s in mine]
        parts.update(zip(mine, model.device(w, ranges)))
    plans = []
    for j, c in enumerate(best):
        w = order.placement[j]
        mem, times = parts[j], [prof.layers[i].time_ms for i in c.layers]
        plans.append(
            StagePlan(
                index=j,
                device=targets[w].name,
                layers=c.layers,
                params_bytes=mem.params_bytes,
                grads_bytes=mem.grads_bytes,
                optimizer_bytes=mem.optimizer_bytes,
                activation_bytes=mem.activation_bytes,
                transient_bytes=mem.transient_bytes,
                peak_bytes=mem.peak_bytes,
                capacity_bytes=targets[w].capacity,
                in_flight=mem.in_flight,
                phase=mem.phase,
                time_ms=None if any(t is None for t in times) else float(sum(times)),  # type: ignore[arg-type]
                worker=w,
                device_peak_bytes=sum(parts[s].peak_bytes for s in order.stages_of(w)),
            )
        )
    return plans


def _explain(model: MemoryModel, targets: list[Target], prof: Profile, devices: int) -> str:
    """Why nothing fits: a layer too big for any device alone, or the tightest stage.

    ``targets`` are per stage: with several stages per device, each has its share."""
    k = len(targets)
    share = "" if k == devices else f" (its share of the device: {k // devices} stages each)"
    where = f"{k} devices" if k == devices else f"{k} stages on {devices} devices"
    for i, layer in enumerate(prof.layers):
        alone = min(model.stage(j, i, i).peak_bytes for j in range(k))
        room = max(t.capacity if t.capacity is not None else math.inf for t in targets)
        if alone > room:
            return (
                f"layer {i} ({layer.type_name}) needs {format_bytes(alone)} on a stage of its own "
                f"but the largest capacity is {format_bytes(room)} (short by "
                f"{format_bytes(alone - room)}); {_remedies(prof)}"
            )
    layers = unconstrained(model, targets)
    worst = max(layers, key=lambda c: c.overflow)
    first, last = worst.layers.start, worst.layers.stop - 1
    return (
        f"no balance of {len(prof)} layers over {where} fits: at best stage {worst.stage}"
        f" (layers {first}..{last} on {targets[worst.stage].name}) needs "
        f"{format_bytes(worst.peak)} but has {format_bytes(targets[worst.stage].capacity)}{share} "
        f"(short by {format_bytes(worst.overflow)}); balance {[len(c.layers) for c in layers]}; "
        f"{_remedies(prof)}"
    )


def _remedies(prof: Profile) -> str:
    hints = "use more devices or larger capacity, checkpoint='always', more chunks"
    if prof.optimizer != "none":
        hints += f", or an optimizer with less state than {prof.optimizer}"
    if prof.shard == 1 and prof.total("optimizer_bytes"):
        hints += (
            "; with data-parallel replicas, shard each stage's state over them (shard=n here, "
            "dp_shard=True in pipepar.distributed.wrap)"
        )
    return hints
