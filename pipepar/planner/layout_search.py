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

The profile may be of any batch: it is scaled to each replica's rows, and a profile without
times (on ``meta``) takes them from FLOP counts
(:func:`~pipepar.planner.flop_count.count_flops`) at the cluster's rate
(:mod:`~pipepar.planner.layout_shape`: the shapes, and those ruled out). Whether a layout fits
and its plan are :mod:`~pipepar.planner.layout_fit`'s, which keeps every schedule and plan it
builds; the bounds that prune, :mod:`~pipepar.planner.step_bounds`'; the message where nothing
fits, :mod:`~pipepar.planner.layout_misfit`'s.

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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from pipepar.core.memory_budget import AUTO
from pipepar.core.named_schedules import NAMES
from pipepar.core.units import parse_bytes
from pipepar.planner.cluster import Cluster
from pipepar.planner.layout import Layout
from pipepar.planner.layout_fit import Fits, per_device
from pipepar.planner.layout_misfit import nothing_fits
from pipepar.planner.layout_shape import Shape, Shapes
from pipepar.planner.plan import CHECKPOINTS, Plan
from pipepar.planner.posted_receives import receives_of
from pipepar.planner.profile import Profile
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
from pipepar.planner.step_bounds import busy_bound, work_bound
from pipepar.planner.step_time import Flops, predict_step

__all__ = ["CHUNKS", "Layout", "search_layouts"]

CHUNKS = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch counts tried by default (those up to a replica's rows)."""

_FRUGAL = ("never", "except_last", "always")
"""Recompute policies from the fastest to the one needing the least memory."""


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
    shapes = Shapes(
        prof, counted, machines, cap, devices=n, rows=rows, chunks=runs, shards=options.shards,
        skipped=[],
    )  # fmt: skip
    found = _Search(shapes, options)
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


class _Search:
    """The search's walk and its ranking: the layouts kept so far, and why a pp or schedule
    was not tried (the shapes' plans are :class:`~pipepar.planner.layout_fit.Fits`')."""

    def __init__(self, shapes: Shapes, options: _Options) -> None:
        self.shapes, self.options = shapes, options
        self.prof, self.cluster, self.rows = shapes.prof, shapes.cluster, shapes.rows
        self.kept: list[Layout] = []
        self.skipped = shapes.skipped  # why a pp or schedule was not tried
        self.fits = Fits(options.ranks)

    # -- the search ---------------------------------------------------------------------------
    def run(self) -> list[Layout]:
        """Every shape, schedule and recompute policy, the most frugal policy first: where it
        does not fit, one that recomputes less does not either."""
        for shape in self.shapes:
            fewest = self.shapes.chunk_counts(shape)[-1]
            for name in self.options.schedules:
                stages = shape.pp * per_device(name)
                if stages > len(self.prof):
                    self.skipped.append(
                        f"{name} on pp={shape.pp}: {stages} stages for {len(self.prof)} layers"
                    )
                    continue
                misfit = 0  # the most micro-batches that did not fit with more recompute
                for checkpoint in reversed(self.options.checkpoints):
                    bound = work_bound(shape.profile, shape.pp, fewest, checkpoint)
                    if bound <= self._threshold():
                        misfit = self._chunks(shape, name, checkpoint, misfit)
        return list(self.kept)

    def _chunks(self, shape: Shape, name: str, checkpoint: str, misfit: int) -> int:
        """Micro-batch counts above ``misfit`` from the largest down, until one does not fit
        (fewer hold more rows at once); the most that did not fit, or ``misfit``.

        With offload among the options, a count that does not fit does not end the walk: a
        larger count cuts each micro-batch's saved tensors smaller, and those under
        :data:`~pipepar.core.offload.MIN_BYTES` stay on the device, so fewer micro-batches
        may fit where more did not."""
        counts = [m for m in self.shapes.chunk_counts(shape) if m > misfit]
        offloads = self.options.offloads
        most = misfit
        for m in counts:
            if name != AUTO:
                fitting = self.fits.fit(shape, name, m, checkpoint, offloads)
            elif self.fits.auto_worth_building(shape, m, checkpoint):
                fitting = self.fits.fit_auto(shape, m, checkpoint, offloads)
            else:
                continue
            if fitting is None:
                if True not in offloads:
                    return m
                most = max(most, m)
                continue
            found, offload = fitting
            if offload:  # nor does a smaller M fit without offload
                offloads = [True]
            # a step at least as long as its busiest device cannot make the top otherwise
            if busy_bound(found, self.options.runtime) <= self._threshold():
                self._keep(self._layout(shape, found, offload))
            if name == AUTO:  # built for the most micro-batches that fit: fewer are not built
                return most
        return most

    def _layout(self, shape: Shape, found: Plan, offload: bool) -> Layout:
        order = self.fits.order(shape, found)
        pred = predict_step(
            shape.timing,
            found.balance,
            cluster=self.cluster,
            schedule=order,
            chunks=order.n_microbatches,
            checkpoint=found.checkpoint,
            dp=shape.dp,
            flops=shape.flops,
            dp_shard=shape.shard,
            runtime=self.options.runtime,
            offload=offload,
        )
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
            capacity_bytes=self.shapes.capacity,
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

    def explain(self) -> str:
        """Why no layout fits (:func:`~pipepar.planner.layout_misfit.nothing_fits`)."""
        return nothing_fits(
            self.shapes,
            self.fits,
            schedules=self.options.schedules,
            checkpoint=self.options.checkpoints[-1],
            offloads=self.options.offloads,
        )
