"""Predict how long one training step takes: a profile's times run through the schedule itself.

The schedule's own action lists are timed (:func:`pipepar.core.schedule.timed`), with each
action's cost read off the profile and each hand-over between devices off the
:class:`~pipepar.planner.cluster.Cluster`. The step is the critical path of that simulation,
plus the gradient all-reduce over data-parallel replicas where it is not hidden.

What the model assumes:

- **Times.** A measured profile gives each layer's forward and backward time for the whole
  sample batch, on the device it ran on (the cluster's devices are taken to be that kind). A
  profile on ``meta`` has none: :func:`~pipepar.planner.flop_count.count_flops` counts each
  layer's FLOPs and a time is ``FLOPs / (cluster.flops * cluster.efficiency)``.
- **Micro-batches.** A layer's time is a part each call costs whatever its rows and a part
  in proportion to them: micro-batch ``i`` of ``rows_i`` rows (the batch split as
  :func:`pipepar.core.microbatch.scatter` splits it) takes ``call + rows_i / batch * (time -
  call)``. The call part is measured (:mod:`pipepar.planner.call_times`: a second profile on
  one micro-batch); without it, and for times from FLOPs, it is 0 and times scale linearly in
  rows, which predicts small micro-batches fast (launches, framework code and products too
  small to fill the device do not shrink with the rows).
- **B and W.** A backward that the schedule splits runs ``weight_share`` of each layer's
  backward with trained parameters in W (for a matrix product, the weight gradient is one
  product of the two in its backward) and the rest in B. The first stage's input needs no
  gradient, so its B computes nothing and W runs its whole backward; a stage with a layer that
  cannot split (:attr:`~pipepar.planner.profile.LayerProfile.splits_backward`) runs it all in B,
  as the runtime does.
- **Gradient sums.** The action making a micro-batch's parameter gradients (W where split
  off, else B) adds them into the sums: ``3 * grads_bytes / memory_bandwidth`` of the
  cluster's device, for every micro-batch but the first (whose gradients become the sums).
- **Recompute.** A checkpointed micro-batch (:func:`pipepar.core.recompute.should_checkpoint`:
  all under ``"always"``, all but the last under ``"except_last"``) runs its forward again at
  the start of its B, on every stage.
- **Transfers.** What crosses a cut (every storage made before it and used after it, the
  sample's included; gradients come back for all but the sample's) takes ``latency + bytes /
  bandwidth`` of the link between the two devices, within a node or across. It delays the
  receiver and occupies no worker (sends run beside compute); links are not shared.
- **Devices.** Worker ``w`` of replica ``r`` is device ``r * K + w`` (the runtime's rank
  layout), so replicas can differ in which cuts cross nodes; the slowest replica is reported.
- **Data parallelism.** With ``dp`` replicas, each stage's gradients (``grads_bytes``) are
  averaged by a ring all-reduce taking ``2 (dp-1)/dp * bytes / bandwidth + 2 (dp-1) *
  latency`` on the slowest link of the ring. As in the runtime, it starts once the stage's last
  backward action of the step has ended on every replica, runs beside the worker's other
  stages, and a worker's all-reduces run one after another. It is not overlapped with the
  stage's own backward, so the step ends when the last all-reduce does.
- **Sharded data parallelism** (``dp_shard=True``, as ``pipepar.distributed.wrap(..., dp=dp,
  dp_shard=True)`` runs it: each stage's state split over its ``dp`` replicas). Each worker
  all-gathers its stages' weights (``params_bytes``, one collective for all of them) at the
  step's start, taking ``(dp-1)/dp * bytes / bandwidth + (dp-1) * latency`` on the slowest link
  of its ring; it runs no action before the gather ends (the runtime gathers before the rank's
  first action, overlapping no compute; a later worker's gather overlaps its wait for the first
  activations). The gradient sums are reduce-scattered in place of the all-reduce: half its
  traffic and latency terms, starting and queued as the all-reduce does. The profile is the
  unsharded one (its whole weights and gradients).
- **The runtime** (``runtime=``, a :class:`~pipepar.planner.runtime_fit.RuntimeFit` fitted to
  steps measured on the machine): each F, B and W takes ``scale`` x its time plus
  ``action_ms``, a recompute ``scale x recompute_scale`` x the forward: workers slowing each
  other, the runtime's own work per action, checkpointing's bookkeeping. Without it the
  actions take the profile's times, which on a shared host predicts short.
- **Offload** (``offload=True``): the copies of saved activations to host memory and back
  (:mod:`pipepar.planner.offload_time`): on a GPU only the part a copy takes beyond the
  action it runs beside; on the CPU every copy, on the worker.
- Not counted: the optimizer step, a loss computed outside the model, sums of weights tied
  across stages, the all-reduce's buckets (one message per stage here), links shared by
  concurrent collectives, the re-shard after the step (it frees memory, moves nothing).

:attr:`StepPrediction.actions` is the simulated timeline as plain data
(:class:`~pipepar.planner.predicted_actions.PredictedAction`): every F, B, W and recompute of
the slowest replica, and every all-gather, all-reduce or reduce-scatter, with its start and end.

    >>> pred = predict_step(prof, [4, 4], schedule="1f1b", chunks=8, cluster="h100x8", dp=2)
    >>> pred.step_ms, pred.bubble
    >>> sharded = predict_step(prof, [4, 4], cluster="h100x8", dp=2, dp_shard=True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from pipepar.core import validation
from pipepar.core.named_schedules import make, n_workers
from pipepar.core.recompute_placement import without_rebuilds
from pipepar.core.schedule import Action, Schedule, timed
from pipepar.planner.action_costs import StepModel
from pipepar.planner.cluster import Cluster
from pipepar.planner.dp_comm import position, reduce_spans, ring_ms
from pipepar.planner.offload_time import offload_ms, sent_bytes
from pipepar.planner.predicted_actions import PredictedAction
from pipepar.planner.profile import Profile
from pipepar.planner.runtime_fit import RuntimeFit, check_runtime

__all__ = ["StageTime", "StepPrediction", "predict_step", "predicted_step_ms"]

Flops = Sequence[tuple[float, float]]
"""Per layer, the (forward, backward) FLOPs of the whole sample batch."""


@dataclass(frozen=True)
class StageTime:
    """What one stage spends over a step (all its micro-batches), in milliseconds.

    Example:
        >>> prediction = predict_step(prof, [2, 2], cluster="h100x8", schedule="1f1b", chunks=4)
        >>> stage = prediction.stages[0]
        >>> stage.index, stage.forward_ms > 0
        (0, True)
    """

    index: int
    """Stage number j."""
    worker: int
    """The worker (device of the first replica) running the stage."""
    layers: range
    """The stage's layers."""
    forward_ms: float
    """Its F actions."""
    input_grad_ms: float
    """Its B actions without recompute: the whole backward where W does not split it off."""
    weight_ms: float
    """Its W actions (parameter gradients split off B)."""
    recompute_ms: float
    """Forwards run again at the start of B for checkpointed micro-batches."""
    transfer_ms: float
    """Moving what crosses the cut after the stage, activations there and gradients back
    (slowest replica); 0 for the last stage and for a next stage on the same worker."""
    allreduce_ms: float
    """The all-reduce of its gradients over the replicas (with ``dp_shard``, their
    reduce-scatter); 0 with ``dp=1``."""

    @property
    def busy_ms(self) -> float:
        """Compute time of the stage: F + B + W + recompute."""
        return self.forward_ms + self.input_grad_ms + self.weight_ms + self.recompute_ms


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step: its time, where the time goes, and the simulated timeline.

    Example:
        >>> prof = pipepar.profile(zoo.mlp(depth=2, width=16), torch.randn(8, 16), device="cpu")
        >>> prediction = predict_step(prof, [2, 2], cluster="h100x8", schedule="1f1b", chunks=4)
        >>> prediction.step_ms > 0, 0 <= prediction.bubble < 1, len(prediction.stages)
        (True, True, 2)
    """

    step_ms: float
    """One training step, from the first forward to the last gradient all-reduce's end."""
    pipeline_ms: float
    """The schedule's span: from the step's start (the first forward; with ``dp_shard``, the
    weights' all-gathers before it) to the last backward action's end."""
    bubble: float
    """Idle fraction of the workers over :attr:`pipeline_ms` (waiting for others or for
    transfers); ``(K-1)/(M+K-1)`` for GPipe and 1F1B with equal stages and free transfers."""
    busy_ms: tuple[float, ...]
    """Per worker, the time it computes (F, B, W, recompute)."""
    stages: tuple[StageTime, ...]
    """Per stage, the parts of its time."""
    exposed_allreduce_ms: float
    """The part of the step spent after :attr:`pipeline_ms` on gradient all-reduces (with
    ``dp_shard``, reduce-scatters)."""
    spans: tuple[tuple[Action, float, float], ...]
    """Every action of the slowest replica with its start and end (ms), in start order."""
    schedule: str
    """The schedule's name."""
    chunks: int
    """Micro-batches M (at most the batch's rows)."""
    dp: int
    """Data-parallel replicas."""
    cluster: str
    """The cluster's name."""
    source: str
    """Where the layer times came from: ``"measured"`` or ``"flops"``."""
    dp_shard: bool = False
    """Whether each stage's state is sharded over the ``dp`` replicas (weights all-gathered
    before the step, gradients reduce-scattered after)."""
    gather_ms: tuple[float, ...] = ()
    """Per worker, the all-gather of its stages' weights at the step's start (zeros without
    ``dp_shard``)."""
    actions: tuple[PredictedAction, ...] = ()
    """The simulated timeline of the slowest replica as plain data, in start order: every F,
    B, W and recompute (at the start of its B), and every all-gather, all-reduce and
    reduce-scatter (zero-length ones left out)."""


def predict_step(
    profile: Profile,
    balance: Sequence[int],
    *,
    cluster: Cluster | str,
    schedule: str | Schedule = "1f1b",
    chunks: int = 8,
    checkpoint: str = "except_last",
    dp: int = 1,
    flops: Flops | None = None,
    weight_share: float = 0.5,
    dp_shard: bool = False,
    runtime: RuntimeFit | None = None,
    offload: bool = False,
) -> StepPrediction:
    """Predict the time of one training step of ``profile`` split by ``balance``.

    Args:
        profile: a measured profile (``pipepar.profile(..., device="cuda:0")``), or any profile
            with ``flops``.
        balance: layers per stage; the virtual-stage schedules take two stages per worker.
        cluster: the machines (a :class:`~pipepar.planner.cluster.Cluster` or a preset name).
        schedule: a name of :data:`pipepar.core.named_schedules.NAMES` or a Schedule.
        chunks: micro-batches per mini-batch M.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        dp: data-parallel replicas of the pipeline, on devices after the first's.
        flops: per layer, (forward, backward) FLOPs of the whole batch; times are then estimated
            from the cluster's FLOP/s instead of read from the profile.
        weight_share: the share of a layer's backward that W runs when split off.
        dp_shard: each stage's parameters, gradients and optimizer state sharded over the
            ``dp`` replicas (``pipepar.distributed.wrap(..., dp_shard=True)``): the weights'
            all-gather before each worker's first action, and a reduce-scatter of the
            gradients in place of the all-reduce. Needs ``dp >= 2`` and the unsharded profile.
        runtime: what the runtime adds to each action on this machine
            (:class:`~pipepar.planner.runtime_fit.RuntimeFit`, fitted by
            :func:`~pipepar.planner.calibrate.fit_runtime`); default: nothing, the profile's
            times as they are.
        offload: activation offload runs (``pipepar.wrap(..., offload=True)``): its copies
            to host memory and back, where they do not run beside compute, lengthen the
            actions (:mod:`pipepar.planner.offload_time`).

    Returns:
        The :class:`StepPrediction`.

    Raises:
        ValueError: no times (a ``meta`` profile without ``flops``), a balance that does not
            fit the profile or the schedule, more devices than the cluster has, ``dp_shard``
            with ``dp=1`` or with a profile already sharded.
        TypeError: ``dp_shard`` not a bool.

    Example:
        >>> pred = predict_step(prof, [2, 2], cluster="h100x8", schedule="zb-h1", chunks=8)
        >>> pred.step_ms > pred.stages[0].forward_ms
        True
    """
    setup = _setup(
        profile,
        balance,
        cluster=cluster,
        schedule=schedule,
        chunks=chunks,
        checkpoint=checkpoint,
        dp=dp,
        flops=flops,
        weight_share=weight_share,
        dp_shard=dp_shard,
        runtime=runtime,
        offload=offload,
    )
    return _predict(setup)


def predicted_step_ms(profile: Profile, balance: Sequence[int], **options: Any) -> float:
    """``predict_step(profile, balance, **options).step_ms``, without the rest of the
    prediction (each stage's parts, the timeline): what a fit asks for thousands of times.

    Example:
        >>> options = dict(cluster="h100x8", schedule="zb-h1", chunks=8)
        >>> full = predict_step(prof, [2, 2], **options)
        >>> predicted_step_ms(prof, [2, 2], **options) == full.step_ms
        True
    """
    return _simulate(_setup(profile, balance, **options)).step


@dataclass(frozen=True)
class _Setup:
    """What a prediction runs: the costs, the machines, the replicas and whence the times."""

    model: StepModel
    cluster: Cluster
    dp: int
    shard: bool
    source: str


def _setup(
    profile: Profile,
    balance: Sequence[int],
    *,
    cluster: Cluster | str,
    schedule: str | Schedule = "1f1b",
    chunks: int = 8,
    checkpoint: str = "except_last",
    dp: int = 1,
    flops: Flops | None = None,
    weight_share: float = 0.5,
    dp_shard: bool = False,
    runtime: RuntimeFit | None = None,
    offload: bool = False,
) -> _Setup:
    """The arguments of :func:`predict_step` checked, and the step's costs."""
    machines = _check_cluster(cluster)
    stage_layers = _ranges(validation.check_balance(balance, len(profile)))
    chunks = validation.check_chunks(chunks)
    checkpoint = validation.check_checkpoint(checkpoint)
    _check_options(dp, weight_share)
    _check_shard(dp_shard, dp, profile)
    runtime = check_runtime(runtime)
    m = max(1, min(chunks, profile.batch_size))
    order = make(schedule, len(stage_layers), m, n_workers=n_workers(schedule, len(stage_layers)))
    without_rebuilds(order, "the planner's step time")
    _check_fits(machines, order.n_workers, dp)
    times = _layer_times(profile, machines, flops)
    model = StepModel(
        profile,
        order,
        stage_layers,
        times,
        checkpoint,
        weight_share,
        per_call=flops is None,
        runtime=runtime,
        memory_bandwidth=machines.memory_bandwidth,
    )
    if validation.check_offload(offload):
        model.extra = offload_ms(
            order,
            sent_bytes(profile, order, stage_layers, checkpoint),
            checkpoint=checkpoint,
            cost=lambda a: model.own(a, order.splits_backward(a.stage, a.microbatch)),
            cluster=machines,
        )
    source = "measured" if flops is None else "flops"
    return _Setup(model, machines, dp, dp_shard, source)


# -- the simulation ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Simulated:
    """The step simulated: each action's cost, each distinct replica's finish times, the
    gathers, the gradient collectives, the pipeline's span and the step's."""

    costs: _Costs
    runs: dict[int, dict[Action, float]]
    gather: list[float]
    reduce_ms: list[float]
    reduces: list[tuple[int, float, float]]
    pipeline: float
    step: float


def _simulate(setup: _Setup) -> _Simulated:
    model, cluster, dp, shard = setup.model, setup.cluster, setup.dp, setup.shard
    order, k = model.order, model.order.n_workers
    gather = [_gather_ms(model, cluster, dp, w) if shard else 0.0 for w in range(k)]
    costs = _costs(model)
    runs = {
        r: timed(order, costs.of, transfer=model.transfer(_devices(r, k), cluster), start=gather)
        for r in _distinct_replicas(cluster, k, dp)
    }
    pipeline = max(max(f.values(), default=0.0) for f in runs.values())
    ready = [max(_last_backward(f, s) for f in runs.values()) for s in range(order.n_stages)]
    reduce_ms = [_reduce_ms(model, cluster, dp, shard, s) for s in range(order.n_stages)]
    reduces = reduce_spans(order, ready, reduce_ms)
    step = max([pipeline, *(end for _, _, end in reduces)])
    return _Simulated(costs, runs, gather, reduce_ms, reduces, pipeline, step)


def _predict(setup: _Setup) -> StepPrediction:
    sim = _simulate(setup)
    model, cluster, dp, shard = setup.model, setup.cluster, setup.dp, setup.shard
    order, k, costs, runs = model.order, model.order.n_workers, sim.costs, sim.runs
    gather, reduce_ms, reduces = sim.gather, sim.reduce_ms, sim.reduces
    pipeline, step = sim.pipeline, sim.step
    replica = max(runs, key=lambda r: max(runs[r].values(), default=0.0))
    busy = [0.0] * k
    for a in runs[replica]:
        busy[order.placement[a.stage]] += costs[a]
    spans = _spans(model, costs, runs[replica])
    return StepPrediction(
        step_ms=step,
        pipeline_ms=pipeline,
        bubble=1.0 - sum(busy) / (pipeline * k) if pipeline > 0 else 0.0,
        busy_ms=tuple(busy),
        stages=tuple(
            _stage_time(model, costs, cluster, replica, reduce_ms[s], s)
            for s in range(order.n_stages)
        ),
        exposed_allreduce_ms=step - pipeline,
        spans=spans,
        schedule=order.name,
        chunks=order.n_microbatches,
        dp=dp,
        cluster=cluster.name,
        source=setup.source,
        dp_shard=shard,
        gather_ms=tuple(gather),
        actions=_actions(model, spans, gather, reduces, shard),
    )


def _devices(replica: int, k: int) -> list[int]:
    """The devices of a replica's workers: ranks are laid out replica by replica."""
    return [replica * k + w for w in range(k)]


def _distinct_replicas(cluster: Cluster, k: int, dp: int) -> list[int]:
    """One replica per way of lying across nodes (the others time the same)."""
    seen: dict[tuple[int, ...], int] = {}
    for r in range(dp):
        nodes = [cluster.node_of(d) for d in _devices(r, k)]
        seen.setdefault(tuple(n - nodes[0] for n in nodes), r)
    return list(seen.values())


class _Costs(dict[Action, float]):
    """Every action's cost in one prediction, worked out once (the simulation of each replica
    and the sums over stages and workers read each action's cost again)."""

    def of(self, a: Action, split: bool) -> float:
        """The cost of ``a`` (``split`` is the schedule's, already read): as ``timed`` asks."""
        return self[a]


def _costs(model: StepModel) -> _Costs:
    order = model.order
    return _Costs((a, model.cost(a, split)) for work in order.waits for a, _, split in work)


def _last_backward(finish: dict[Action, float], s: int) -> float:
    """When stage ``s``'s gradients are final: the end of its last B or W."""
    return max((t for a, t in finish.items() if a.stage == s and a.kind != "F"), default=0.0)


def _reduce_ms(model: StepModel, cluster: Cluster, dp: int, shard: bool, s: int) -> float:
    """Stage ``s``'s gradients over the ``dp`` replicas: a ring all-reduce, or with ``shard``
    a reduce-scatter (half its traffic)."""
    devices = position(model.order.n_workers, dp, model.order.placement[s])
    return ring_ms(cluster, devices, model.grads[s], passes=1 if shard else 2)


def _gather_ms(model: StepModel, cluster: Cluster, dp: int, w: int) -> float:
    """Worker ``w``'s all-gather of its stages' weights over the ``dp`` replicas."""
    nbytes = sum(model.params[s] for s in model.order.stages_of(w))
    return ring_ms(cluster, position(model.order.n_workers, dp, w), nbytes, passes=1)


def _stage_time(
    model: StepModel, costs: _Costs, cluster: Cluster, replica: int, reduce: float, s: int
) -> StageTime:
    order = model.order
    actions = order.stage(s)
    recompute = sum(model.recompute(a) for a in actions if a.kind == "B")
    backward = sum(costs[a] for a in actions if a.kind == "B")
    moved = 0.0
    if s + 1 < order.n_stages:
        delay = model.transfer(_devices(replica, order.n_workers), cluster)
        for i in range(order.n_microbatches):
            moved += delay(Action(s, "F", i), Action(s + 1, "F", i))
            moved += delay(Action(s + 1, "B", i), Action(s, "B", i))
    return StageTime(
        index=s,
        worker=order.placement[s],
        layers=model.layers[s],
        forward_ms=float(sum(costs[a] for a in actions if a.kind == "F")),
        input_grad_ms=backward - recompute,
        weight_ms=float(sum(costs[a] for a in actions if a.kind == "W")),
        recompute_ms=recompute,
        transfer_ms=moved,
        allreduce_ms=reduce,
    )


def _spans(
    model: StepModel, costs: _Costs, finish: dict[Action, float]
) -> tuple[tuple[Action, float, float], ...]:
    spans = [(a, end - costs[a], end) for a, end in finish.items()]
    return tuple(sorted(spans, key=lambda x: (x[1], model.order.placement[x[0].stage])))


def _actions(
    model: StepModel,
    spans: Sequence[tuple[Action, float, float]],
    gather: Sequence[float],
    reduces: Sequence[tuple[int, float, float]],
    shard: bool,
) -> tuple[PredictedAction, ...]:
    """The timeline as plain data: the gathers, every action (a checkpointed B's recompute at
    its start), the gradient collectives; in start order, zero-length collectives left out."""
    place = model.order.placement
    out = [PredictedAction(w, None, "all-gather", None, 0.0, g) for w, g in enumerate(gather) if g]
    for a, start, end in spans:
        out.append(PredictedAction(place[a.stage], a.stage, a.kind, a.microbatch, start, end))
        again = model.recompute(a) if a.kind == "B" else 0.0
        if again > 0:
            out.append(
                PredictedAction(
                    place[a.stage], a.stage, "recompute", a.microbatch, start, start + again
                )
            )
    kind = "reduce-scatter" if shard else "all-reduce"
    out += [PredictedAction(place[s], s, kind, None, t0, t1) for s, t0, t1 in reduces if t1 > t0]
    return tuple(sorted(out, key=lambda x: (x.start_ms, x.worker)))


# -- inputs ------------------------------------------------------------------------------------
def _layer_times(
    profile: Profile, cluster: Cluster, flops: Flops | None
) -> list[tuple[float, float]]:
    """Per layer (forward_ms, backward_ms) for the whole batch: measured, or from FLOPs."""
    if flops is not None:
        rate = cluster.flops * cluster.efficiency / 1e3  # FLOP per ms
        return [(f / rate, b / rate) for f, b in _check_flops(flops, len(profile))]
    if not profile.timed:
        raise ValueError(
            f"the profile (on {profile.device}) has no layer times; profile on a real device "
            "(pipepar.profile(model, sample, device='cuda:0')), or pass flops="
            "count_flops(model, sample, profile) to estimate them from the cluster's FLOP/s"
        )
    return [(x.forward_ms or 0.0, x.backward_ms or 0.0) for x in profile.layers]


def _check_flops(flops: Flops, n: int) -> list[tuple[float, float]]:
    pairs = list(flops)
    if len(pairs) != n:
        raise ValueError(
            f"flops has {len(pairs)} entries but the profile has {n} layers; pass one "
            "(forward, backward) pair per layer, e.g. count_flops(model, sample, profile)"
        )
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(math.isfinite(x) and x >= 0 for x in pair):
            raise ValueError(
                f"flops[{i}] is {pair!r}; each entry must be two finite FLOP counts >= 0 "
                "(forward, backward)"
            )
    return [(float(f), float(b)) for f, b in pairs]


def _ranges(balance: list[int]) -> list[range]:
    ends = list(accumulate(balance))
    return [range(end - n, end) for end, n in zip(ends, balance)]


def _check_cluster(cluster: object) -> Cluster:
    if isinstance(cluster, str):
        return Cluster.named(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"cluster must be a Cluster or a preset name, got {type(cluster).__name__}; pass "
            "e.g. cluster='h100x8' or cluster=measure_local()"
        )
    return cluster


def _check_options(dp: object, share: object) -> None:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an int >= 1 (data-parallel replicas), got {dp!r}; pass 1")
    if not (isinstance(share, (int, float)) and 0 <= share <= 1):
        raise ValueError(
            f"weight_share must be in [0, 1], got {share!r}; 0.5 puts half of a layer's "
            "backward in W"
        )


def _check_shard(shard: object, dp: int, profile: Profile) -> None:
    if not isinstance(shard, bool):
        raise TypeError(f"dp_shard must be True or False, got {shard!r}; pass dp_shard=True")
    if shard and dp < 2:
        raise ValueError(
            f"dp_shard=True shards each stage over its dp replicas, but dp={dp}; pass dp=2 or "
            "more, or dp_shard=False"
        )
    if shard and profile.shard != 1:
        raise ValueError(
            f"dp_shard=True times the whole weights and gradients, but the profile is already "
            f"sharded (profile.shard={profile.shard}); pass the unsharded profile (the one "
            "given to pipepar.plan(..., shard=n), not plan.profile)"
        )


def _check_fits(cluster: Cluster, k: int, dp: int) -> None:
    if k * dp > cluster.devices:
        nodes = -(-k * dp // cluster.devices_per_node)
        raise ValueError(
            f"{k} workers x dp={dp} need {k * dp} devices but cluster {cluster.name!r} has "
            f"{cluster.devices} ({cluster.nodes} node(s) of {cluster.devices_per_node}); pass "
            f"a cluster with nodes={nodes}, e.g. Cluster.named({cluster.name!r}, nodes={nodes})"
        )
