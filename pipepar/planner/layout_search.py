"""Choose the whole layout: pipeline and data-parallel degrees, schedule, micro-batches,
recompute, activation offload and balance, ranked by predicted throughput.

For ``N`` devices and a global batch of ``G`` rows, every ``N = pp x dp`` is a candidate: ``dp``
replicas of a pipeline over ``pp`` devices, each replica taking ``G / dp`` rows per step. With
``dp >= 2`` the replicas either hold each stage's state whole (replicated, gradients
all-reduced) or shard it over themselves (``dp_shard``: ``pipepar.distributed.wrap(...,
dp_shard=True)``), both tried by default: a sharded layout's memory is one rank's of its
group (:func:`~pipepar.planner.sharded_state.sharded`, as ``pipepar.plan(..., shard=dp)``
has it) and its step has the weights' all-gather and the gradients' reduce-scatter
(:func:`~pipepar.planner.step_time.predict_step` with ``dp_shard=True``). For each, every
schedule (the virtual-stage ones with two stages per device), number of
micro-batches ``M`` and recompute policy is tried with the balance :func:`pipepar.plan` picks
(the split with the smallest bottleneck among those that fit, from
:class:`~pipepar.planner.stage_memory.MemoryModel`) and the step that
:func:`~pipepar.planner.step_time.predict_step` predicts for it. Layouts that fit are ranked by
rows per second, ``G / step``.

The profile may be of any batch: it is scaled to each replica's rows
(:func:`~pipepar.planner.profile_rows.at_rows`), linearly, as the planner scales a batch to its
micro-batches. A profile without times (on ``meta``) takes them from FLOP counts
(:func:`~pipepar.planner.flop_count.count_flops`) at the cluster's rate, so the balance
minimizes the slowest stage's time there too.

How it prunes (``pp`` devices per pipeline):

- exactly: a ``pp`` with more stages than layers, a ``dp`` that does not divide the batch, a
  ``pp`` whose parameters, gradients and optimizer state alone exceed ``pp`` devices (for a
  sharded layout, one rank's: the gathered weights and gradient sums and its shards), and a
  (``pp``, recompute) whose work spread evenly with no bubble cannot beat the ``top``-th
  layout found are not tried; nor is a step predicted for a layout whose busiest device's
  work alone cannot;
- by the memory model's trends: ``M`` is tried from the largest down, and once one does not
  fit no smaller one is (fewer micro-batches hold more rows at once); recompute policies go
  from the most frugal, and one recomputing less is not tried with an ``M`` where a more
  frugal one did not fit. Rows that ``M`` does not divide round the micro-batch up, and
  recomputing puts a forward's work space in the backward, so these are not proofs.

Activation offload (``offloads``) is one more choice per layout: a (``pp``, schedule, ``M``,
recompute) that does not fit is tried again with offload, its memory from
:class:`~pipepar.planner.stage_memory.MemoryModel` with ``offload=True`` and its step with the
copies' cost (:mod:`pipepar.planner.offload_time`); one that fits is not (offload only adds
copies). For the prunes above, a layout fits if it does with or without offload; once an
``M`` fits only with offload, smaller ones are tried with offload only. Left to the search
(``offloads=None``), offload is tried only on devices with memory of their own
(``cluster.host`` set): on the CPU the host memory is the devices' memory, and a fit by
offload would be a fit on paper only.

Schedules are built once per (``pp``, schedule, ``M``) and shared by the recompute policies.

``"auto"`` among the schedules (opt-in) is the order built for the capacity each device has
left (:mod:`~pipepar.planner.auto_fit`), tried only where none of the named V schedules fits
that (``pp``, ``M``, recompute) without offload, and only at the largest ``M`` where it fits
(per ``pp`` and recompute): the budget search costs up to seconds, and where a named V fits it
does as well.

    >>> layouts = search_layouts(prof, devices=64, batch=512, cluster="h100x8",
    ...                          capacity="80GiB", flops=count_flops(model, sample, prof))
    >>> best = layouts[0]
    >>> best.pp, best.dp, best.dp_shard, best.schedule, best.chunks, best.checkpoint
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from pipepar.core.memory_budget import AUTO
from pipepar.core.named_schedules import NAMES, VIRTUAL
from pipepar.core.schedule import Schedule
from pipepar.core.units import format_bytes, parse_bytes
from pipepar.planner.auto_fit import fit_auto
from pipepar.planner.cluster import Cluster
from pipepar.planner.layout import Layout
from pipepar.planner.peak_moments import schedule_for
from pipepar.planner.plan import CHECKPOINTS, Plan, fit
from pipepar.planner.plan_search import unconstrained
from pipepar.planner.plan_targets import Target, resolve_targets
from pipepar.planner.posted_receives import receives_of
from pipepar.planner.profile import Profile
from pipepar.planner.profile_rows import at_rows
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.planner.search_inputs import (
    check_choices,
    check_count,
    check_counts,
    check_offloads,
    check_shards,
    search_cluster,
    search_profile,
)
from pipepar.planner.sharded_state import sharded
from pipepar.planner.stage_memory import MemoryModel
from pipepar.planner.step_time import Flops, StepPrediction, predict_step

__all__ = ["CHUNKS", "Layout", "search_layouts"]

CHUNKS = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch counts tried by default (those up to a replica's rows)."""

_FRUGAL = ("never", "except_last", "always")
"""Recompute policies from the fastest to the one needing the least memory."""

_V = ("zb-v", "v-half", "v-min")
"""The named schedules of two stages per device in a V: ``"auto"`` is tried where none fits."""

_LEAN = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "v-min", "v-half")
"""Schedules whose need is told when nothing fits, the first of them searched: 1F1B's (the
usual yardstick), else the rest's (v-min and v-half hold less, with two stages per device)."""


def search_layouts(
    model_or_profile: nn.Module | Profile,
    sample: Any = None,
    *,
    devices: int,
    batch: int,
    cluster: Cluster | str,
    capacity: int | str | None = None,
    optimizer: object = "adam",
    flops: Flops | None = None,
    schedules: Sequence[str] = NAMES,
    chunks: Sequence[int] = CHUNKS,
    checkpoints: Sequence[str] = CHECKPOINTS,
    top: int | None = 10,
    profile_device: str = "meta",
    shards: Sequence[bool] = (False, True),
    runtime: RuntimeFit | None = None,
    offloads: Sequence[bool] | None = None,
    ranks: str | None = None,
) -> list[Layout]:
    """The fastest layouts of the model on ``devices`` devices that fit, fastest first.

    Args:
        model_or_profile: a :class:`~pipepar.planner.profile.Profile` (of any batch), or a
            model to profile on ``profile_device`` with ``sample`` (an ``nn.Sequential`` by its
            layers, any other module by its units, as :func:`pipepar.plan` and
            ``pipepar plan`` do).
        sample: an input batch, when a model is given.
        devices: all devices, N; every ``pp x dp = N`` is tried.
        batch: the global batch G in rows; a replica takes ``G / dp``.
        cluster: the machines (a :class:`~pipepar.planner.cluster.Cluster`, or a preset name,
            given as many nodes as ``devices`` needs).
        capacity: bytes per device (``"80GiB"``); None for the cluster's device memory.
        optimizer: whose state to count (see :func:`pipepar.profile`).
        flops: per layer, the (forward, backward) FLOPs of the profile's batch, for a profile
            without times; counted here when a model is given.
        schedules: the schedules to try: names of
            :data:`~pipepar.core.named_schedules.NAMES`, and ``"auto"`` (not by default):
            where no named V schedule fits a pipeline of ``pp >= 2`` at a count of
            micro-batches and recompute, the order built for what each device has left of
            ``capacity`` (:mod:`pipepar.planner.auto_fit`; without offload), kept in
            :attr:`Layout.order`.
        chunks: the micro-batch counts to try (those up to a replica's rows).
        checkpoints: the recompute policies to try.
        top: how many layouts to return (the rest are pruned early); None for every layout
            that fits.
        profile_device: where to profile a model.
        shards: for ``dp >= 2``, whether to try each stage's state replicated (``False``)
            and sharded over the replicas (``True``); ``dp = 1`` is replicated only.
        runtime: what the runtime adds to each action on these machines, as
            :func:`~pipepar.planner.step_time.predict_step` takes it (fitted to measured
            steps by :func:`pipepar.planner.calibrate.fit_runtime`); None: the profile's
            times as they are.
        offloads: whether to try layouts without activation offload (``False``) and with
            it (``True``, ``pipepar.wrap(..., offload=True)``); one with offload is tried
            only where the same layout without it does not fit. None (the search's choice):
            both where the devices have memory of their own (``cluster.host`` set, a GPU's),
            none with offload where their memory is the host's (the CPU: offload there
            frees torch's allocator, not the machine, so its fit would be false); pass
            ``(True,)`` or ``(False, True)`` to price it there all the same.
        ranks: the devices are ranks of ``pipepar.distributed``: ``"program"`` (any model)
            or ``"chain"`` (an ``nn.Sequential``), whose receives posted ahead of their
            messages each device holds too (:mod:`pipepar.planner.posted_receives`); None:
            one process (``pipepar.wrap``).

    Returns:
        Up to ``top`` :class:`Layout` s, by throughput, fastest first.

    Raises:
        ValueError: bad arguments, or nothing fits; the message names the smallest capacity
            a layout needs, or what rules every layout out.

    Example:
        >>> layouts = search_layouts(model, torch.randn(8, 1024), devices=8, batch=64,
        ...                          cluster="h100x8", capacity="16GiB", top=3)
        >>> [(x.pp, x.dp, x.schedule) for x in layouts]
    """
    n = check_count("devices", devices, "e.g. devices=8")
    rows = check_count("batch", batch, "e.g. batch=512 rows")
    machines = search_cluster(cluster, n)
    options = _Options(
        schedules=check_choices("schedules", schedules, (*NAMES, AUTO)),
        chunks=sorted(set(check_counts("chunks", chunks)), reverse=True),
        checkpoints=sorted(
            check_choices("checkpoints", checkpoints, CHECKPOINTS), key=_FRUGAL.index
        ),
        top=None if top is None else check_count("top", top, "e.g. top=10, or None for all"),
        shards=check_shards(shards),
        runtime=runtime,
        offloads=check_offloads(offloads, machines),
        ranks=ranks,
    )
    receives_of(ranks)  # an unknown name fails here, before the profile
    cap = machines.memory_bytes if capacity is None else parse_bytes(capacity, name="capacity")
    prof, counted, runs = search_profile(
        model_or_profile,
        sample,
        optimizer=optimizer,
        device=profile_device,
        flops=flops,
        chunks=options.chunks,
    )
    options = replace(options, chunks=runs)
    found = _Search(prof, counted, machines, cap, n, rows, options)
    layouts = found.run()
    if not layouts:
        raise ValueError(found.explain())
    return layouts


@dataclass(frozen=True)
class _Options:
    schedules: list[str]
    chunks: list[int]  # largest first
    checkpoints: list[str]  # fastest first, the most frugal last
    top: int | None
    shards: list[bool]  # replicated (False) and/or sharded (True), for dp >= 2
    runtime: RuntimeFit | None
    offloads: list[bool]  # without offload (False) first, then with it (True)
    ranks: str | None  # the runtime across ranks (what receives it posts ahead), or None


@dataclass(frozen=True)
class _Shape:
    """One pipeline degree and sharding: its replicas, their rows and the profile scaled to
    them (``profile`` as one rank holds it, for memory; ``timing`` unsharded, for the step)."""

    pp: int
    dp: int
    rows: int
    profile: Profile
    flops: Flops | None
    targets: list[Target]
    shard: bool
    timing: Profile


class _Search:
    """The search's state: the layouts kept so far, what was built, what did not fit."""

    def __init__(
        self,
        prof: Profile,
        flops: Flops | None,
        cluster: Cluster,
        capacity: int,
        devices: int,
        rows: int,
        options: _Options,
    ) -> None:
        self.prof, self.flops, self.cluster, self.capacity = prof, flops, cluster, capacity
        self.devices, self.rows, self.options = devices, rows, options
        self.kept: list[Layout] = []
        self.schedules: dict[tuple[str, int, int], Schedule] = {}
        self.plans: dict[tuple[Any, ...], Plan | None] = {}  # fits, by shape, order, recompute
        self.built: dict[tuple[Any, ...], Schedule] = {}  # "auto"'s orders, by shape, M, ...
        self.shapes: dict[tuple[int, bool], tuple[int, int]] = {}  # (pp, shard) -> (dp, rows)
        self.statics: dict[tuple[int, bool], int] = {}  # (dp, shard) -> state bytes, all layers
        self.skipped: list[str] = []  # why a pp or schedule was not tried

    # -- the search ---------------------------------------------------------------------------
    def run(self) -> list[Layout]:
        """Every shape, schedule and recompute policy, the most frugal policy first: where it
        does not fit, one that recomputes less does not either."""
        for shape in self._shapes():
            for name in self.options.schedules:
                stages = shape.pp * _per_device(name)
                if stages > len(self.prof):
                    self.skipped.append(
                        f"{name} on pp={shape.pp}: {stages} stages for {len(self.prof)} layers"
                    )
                    continue
                misfit = 0  # the most micro-batches that did not fit with more recompute
                for checkpoint in reversed(self.options.checkpoints):
                    if self._work_bound(shape, checkpoint) <= self._threshold():
                        misfit = self._chunks(shape, name, checkpoint, misfit)
        return list(self.kept)

    def _shapes(self) -> Iterator[_Shape]:
        for pp in (d for d in range(1, self.devices + 1) if self.devices % d == 0):
            dp = self.devices // pp
            rows = self.rows // dp
            if pp > len(self.prof):
                self.skipped.append(f"pp={pp}: more devices than the {len(self.prof)} layers")
            elif self.rows % dp:
                self.skipped.append(f"dp={dp}: does not divide the batch of {self.rows} rows")
            elif rows < self.options.chunks[-1]:
                self.skipped.append(f"dp={dp}: {rows} rows per replica, fewer than any chunks")
            else:
                yield from self._variants(pp, dp, rows)

    def _variants(self, pp: int, dp: int, rows: int) -> Iterator[_Shape]:
        """The pipeline degree replicated and sharded, those asked for (sharded: ``dp >= 2``),
        but not one whose parameters, gradients and optimizer state alone do not fit."""
        for shard in self.options.shards:
            if shard and dp == 1:
                if False not in self.options.shards:
                    self.skipped.append(f"pp={pp}: dp=1, no replicas to shard over")
                continue
            self.shapes[(pp, shard)] = (dp, rows)
            static = math.ceil(self._static(dp, shard) / pp)
            if static > self.capacity:
                self.skipped.append(
                    f"pp={pp}{_sharded(shard, dp)}: parameters, gradients and optimizer state "
                    f"alone take {format_bytes(static)} per device"
                )
            else:
                yield self._shape(pp, dp, rows, shard)

    def _static(self, dp: int, shard: bool) -> int:
        """Parameters, gradients and optimizer state of all layers, as one rank of a shard
        group of ``dp`` holds them through a step when ``shard`` (whole otherwise)."""
        key = (dp, shard)
        if key not in self.statics:
            prof = sharded(self.prof, dp) if shard else self.prof
            layers = prof.layers
            self.statics[key] = sum(
                x.params_bytes + x.grads_bytes + x.optimizer_bytes for x in layers
            )
        return self.statics[key]

    def _shape(self, pp: int, dp: int, rows: int, shard: bool) -> _Shape:
        scaled = at_rows(self.prof, rows)
        r = rows / self.prof.batch_size
        flops = None if self.flops is None else [(f * r, b * r) for f, b in self.flops]
        if flops is not None:  # times for the balance, as predict_step reckons them
            scaled = _with_times(scaled, flops, self.cluster)
        targets = resolve_targets(pp, self.capacity, layers=len(scaled))
        memory = sharded(scaled, dp) if shard else scaled
        return _Shape(pp, dp, rows, memory, flops, targets, shard, scaled)

    def _chunks(self, shape: _Shape, name: str, checkpoint: str, misfit: int) -> int:
        """Micro-batch counts above ``misfit`` from the largest down, until one does not fit
        (fewer hold more rows at once); the most that did not fit, or ``misfit``.

        With offload among the options, a count that does not fit does not end the walk: a
        larger count cuts each micro-batch's saved tensors smaller, and those under
        :data:`~pipepar.core.offload.MIN_BYTES` stay on the device, so fewer micro-batches
        may fit where more did not."""
        counts = [m for m in self._chunk_counts(shape) if m > misfit]
        offloads = self.options.offloads
        most = misfit
        for m in counts:
            if name != AUTO:
                fitting = self._fit(shape, self._schedule(name, shape.pp, m), checkpoint, offloads)
            elif shape.pp < 2 or self._v_fits(shape, m, checkpoint):
                continue  # one device runs its stages in turn; where a named V fits, it does
                # as well as the costly budget search
            else:
                fitting = self._fit_auto(shape, m, checkpoint, offloads)
            if fitting is None:
                if True not in offloads:
                    return m
                most = max(most, m)
                continue
            found, offload = fitting
            if offload:  # nor does a smaller M fit without offload
                offloads = [True]
            # a step at least as long as its busiest device cannot make the top otherwise
            if _busy_bound(found, self.options.runtime) <= self._threshold():
                self._keep(self._layout(shape, found, offload))
            if name == AUTO:  # built for the most micro-batches that fit: fewer are not built
                return most
        return most

    def _fit(
        self, shape: _Shape, order: Schedule, checkpoint: str, offloads: list[bool]
    ) -> tuple[Plan, bool] | None:
        """The plan of ``order`` that fits, and whether it offloads: without offload where it
        fits so (offload only adds copies), else with it (of ``offloads``); None if neither."""
        for offload in offloads:
            found = self._plan(shape, order, checkpoint, offload)
            if found is not None:
                return found, offload
        return None

    def _plan(self, shape: _Shape, order: Schedule, checkpoint: str, offload: bool) -> Plan | None:
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
                ranks=self.options.ranks,
            )
            self.plans[key] = fit(shape.profile, memory, shape.targets)
        return self.plans[key]

    def _v_fits(self, shape: _Shape, m: int, checkpoint: str) -> bool:
        """Whether a named V schedule fits ``m`` micro-batches without offload."""
        return any(
            self._plan(shape, self._schedule(v, shape.pp, m), checkpoint, False) is not None
            for v in _V
        )

    def _fit_auto(
        self, shape: _Shape, m: int, checkpoint: str, offloads: list[bool]
    ) -> tuple[Plan, bool] | None:
        """The plan of the order built for what each device has left (:mod:`~pipepar.
        planner.auto_fit`), and False (it does not offload); None if it does not fit or
        offload alone is asked for."""
        if False not in offloads:
            return None
        found = fit_auto(shape.profile, shape.targets, chunks=m, checkpoint=checkpoint,
                         ranks=self.options.ranks)  # fmt: skip
        if found is None:
            return None
        plan, order = found
        self.built[(shape.pp, shape.dp, shape.shard, m, checkpoint)] = order
        return plan, False

    def _chunk_counts(self, shape: _Shape) -> list[int]:
        """The micro-batch counts to try for a replica, largest first."""
        return [c for c in self.options.chunks if c <= shape.rows]

    def _schedule(self, name: str, pp: int, m: int) -> Schedule:
        key = (name, pp, m)
        if key not in self.schedules:
            self.schedules[key] = schedule_for(name, pp, m)
        return self.schedules[key]

    def _predict(
        self, shape: _Shape, order: Schedule, balance: list[int], checkpoint: str, offload: bool
    ) -> StepPrediction:
        return predict_step(
            shape.timing,
            balance,
            cluster=self.cluster,
            schedule=order,
            chunks=order.n_microbatches,
            checkpoint=checkpoint,
            dp=shape.dp,
            flops=shape.flops,
            dp_shard=shape.shard,
            runtime=self.options.runtime,
            offload=offload,
        )

    def _layout(self, shape: _Shape, found: Plan, offload: bool) -> Layout:
        if found.schedule == AUTO:
            key = (shape.pp, shape.dp, shape.shard, found.chunks, found.checkpoint)
            order = self.built[key]
        else:
            order = self.schedules[(found.schedule, shape.pp, found.chunks)]
        pred = self._predict(shape, order, found.balance, found.checkpoint, offload)
        peaks = {s.worker: s.device_peak_bytes for s in found.stages}
        return Layout(
            pp=shape.pp,
            dp=shape.dp,
            schedule=found.schedule,
            chunks=found.chunks,
            checkpoint=found.checkpoint,
            balance=tuple(found.balance),
            rows=shape.rows,
            step_ms=pred.step_ms,
            throughput=1e3 * self.rows / pred.step_ms if pred.step_ms > 0 else math.inf,
            peak_bytes=tuple(peaks[w] for w in range(shape.pp)),
            capacity_bytes=self.capacity,
            prediction=pred,
            plan=replace(found, prediction=pred),
            dp_shard=shape.shard,
            offload=offload,
            order=order if found.schedule == AUTO else None,
        )

    # -- ranking ------------------------------------------------------------------------------
    def _keep(self, layout: Layout) -> None:
        """Rank ``layout`` among those kept, keeping the ``top``."""
        self.kept.append(layout)
        self.kept.sort(key=self._rank)
        if self.options.top is not None:
            del self.kept[self.options.top :]

    def _rank(self, x: Layout) -> tuple[Any, ...]:
        """Fastest first; then without offload before with it, the least memory, the shortest
        pipeline, the order given, replicated before sharded."""
        return (
            x.step_ms,
            x.offload,
            max(x.peak_bytes),
            x.pp,
            self.options.schedules.index(x.schedule),
            -x.chunks,
            _FRUGAL.index(x.checkpoint),
            x.dp_shard,
        )

    def _threshold(self) -> float:
        """The step a layout must beat to be kept: the ``top``-th's, once there are that many."""
        top = self.options.top
        if top is None or len(self.kept) < top:
            return math.inf
        return self.kept[-1].step_ms

    def _work_bound(self, shape: _Shape, checkpoint: str) -> float:
        """A replica's work spread evenly over its devices with no bubble (ms), the fewest
        micro-batches recomputed: a lower bound of the step, as some device does its share."""
        layers = shape.profile.layers
        work = sum((x.forward_ms or 0.0) + (x.backward_ms or 0.0) for x in layers)
        fewest = self._chunk_counts(shape)[-1]
        share = {"never": 0.0, "except_last": (fewest - 1) / fewest, "always": 1.0}[checkpoint]
        return (work + share * sum(x.forward_ms or 0.0 for x in layers)) / shape.pp

    # -- nothing fits -------------------------------------------------------------------------
    def explain(self) -> str:
        """Why no layout fits: the least capacity one needs, or what ruled each pp out."""
        what = (
            f"no layout fits {self.devices} devices of {format_bytes(self.capacity)} with a "
            f"batch of {self.rows} rows"
        )
        fixes = "use larger or more devices, a smaller batch, or an optimizer with less state"
        if self.cluster.host is None and True not in self.options.offloads:
            fixes += " (activation offload is not tried: these devices' memory is the host's)"
        least = self._least_needed()
        if least is None:
            return f"{what}: {'; '.join(self.skipped) or 'nothing to try'}; {fixes}"
        need, shape, memory = least
        order = memory.schedule
        return (
            f"{what}: the least any needs is about {format_bytes(need)} per device (pp="
            f"{shape.pp}, dp={shape.dp}{' sharded' if shape.shard else ''}, {order.name}, "
            f"{order.n_microbatches} micro-batches, "
            f"checkpoint={memory.checkpoint!r}{', offload' if memory.offload else ''}), "
            f"{format_bytes(need - self.capacity)} more; "
            f"{fixes}"
        )

    def _least_needed(self) -> tuple[int, _Shape, MemoryModel] | None:
        """About the least capacity a layout needs: with the schedule that holds the least
        (1F1B, of those searched), the most micro-batches, the most frugal recompute and
        offload where it may be tried. Each
        ``pp`` costs a search of its own, so they go from the least parameter bytes per
        device (a lower bound of the need) up, while that bound is below the least found."""
        name = next((n for n in _LEAN if n in self.options.schedules), "v-min")
        best: tuple[int, _Shape, MemoryModel] | None = None
        bounds = {key: self._static(dp, key[1]) / key[0] for key, (dp, _) in self.shapes.items()}
        for pp, shard in sorted(self.shapes, key=lambda key: bounds[key]):
            if best is not None and bounds[(pp, shard)] >= best[0]:
                break
            if pp * _per_device(name) > len(self.prof):
                continue
            shape = self._shape(pp, *self.shapes[(pp, shard)], shard)
            order = self._schedule(name, pp, self._chunk_counts(shape)[0])
            foreach = [t.foreach for t in shape.targets]
            memory = MemoryModel(
                shape.profile,
                order,
                checkpoint=self.options.checkpoints[-1],
                foreach=foreach,
                offload=self.options.offloads[-1],
                ranks=self.options.ranks,
            )
            need = _needed(memory, foreach[0])
            if best is None or need < best[0]:
                best = (need, shape, memory)
        return best


def _per_device(name: str) -> int:
    """Stages per device of schedule ``name`` (``"auto"`` builds a V or a loop of two)."""
    return 2 if name in VIRTUAL or name == AUTO else 1


def _sharded(shard: bool, dp: int) -> str:
    """`` sharded over its dp=n replicas`` for a sharded shape, for messages; else nothing."""
    return f" sharded over its dp={dp} replicas" if shard else ""


def _needed(memory: MemoryModel, foreach: bool) -> int:
    """The least capacity a schedule needs: the split with the smallest largest stage, a
    device's stages each within its share of it, as :func:`pipepar.plan` requires."""
    order = memory.schedule
    bare = [Target(f"stage {s}", 0, foreach) for s in range(order.n_stages)]
    split = unconstrained(memory, bare)
    return order.n_stages // order.n_workers * max(c.peak for c in split)


def _busy_bound(found: Plan, runtime: RuntimeFit | None) -> float:
    """The busiest device's compute over the step (ms), a lower bound of the step: its
    stages' forward and backward, and the forwards run again for checkpointed micro-batches
    (each scaled as the runtime's fit scales it)."""
    fit = runtime or RuntimeFit()
    m = found.chunks
    share = {"never": 0.0, "except_last": (m - 1) / m, "always": 1.0}[found.checkpoint]
    busy: dict[int, float] = {}
    for s in found.stages:
        forward = sum(found.layers[i].forward_ms or 0.0 for i in s.layers)
        again = m * share * fit.recompute(forward / m, len(s.layers))
        work = fit.scale * (s.time_ms or 0.0) + again
        busy[s.worker] = busy.get(s.worker, 0.0) + work
    return max(busy.values())


def _with_times(prof: Profile, flops: Flops, cluster: Cluster) -> Profile:
    """``prof`` with each layer's times from its FLOPs at the cluster's rate."""
    rate = cluster.flops * cluster.efficiency / 1e3  # FLOP per ms
    layers = [
        replace(layer, forward_ms=f / rate, backward_ms=b / rate)
        for layer, (f, b) in zip(prof.layers, flops)
    ]
    return replace(prof, layers=layers)
