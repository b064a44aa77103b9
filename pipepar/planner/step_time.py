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
- **Micro-batches.** Times scale linearly in rows: micro-batch ``i`` of ``rows_i`` rows (the
  batch split as :func:`pipepar.core.microbatch.scatter` splits it) takes ``rows_i / batch`` of
  the whole batch's time, so with ``M`` dividing the batch a stage's F takes its layers' time /
  ``M``. Small micro-batches run below that rate on real devices (kernels too small to fill
  them), so small micro-batches are predicted a little fast.
- **B and W.** A backward that the schedule splits runs ``weight_share`` of each layer's
  backward with trained parameters in W (for a matrix product, the weight gradient is one
  product of the two in its backward) and the rest in B. The first stage's input needs no
  gradient, so its B computes nothing and W runs its whole backward; a stage with a layer that
  cannot split (:attr:`~pipepar.planner.profile.LayerProfile.splits_backward`) runs it all in B,
  as the runtime does.
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
- Not counted: the optimizer step, a loss computed outside the model, sums of weights tied
  across stages, the all-reduce's buckets (one message per stage here).

    >>> pred = predict_step(prof, [4, 4], schedule="1f1b", chunks=8, cluster="h100x8", dp=2)
    >>> pred.step_ms, pred.bubble
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipepar.core import validation
from pipepar.core.recompute import should_checkpoint
from pipepar.core.schedule import Action, Schedule, make, n_workers, timed
from pipepar.planner.cluster import Cluster
from pipepar.planner.profile import Profile

__all__ = ["StageTime", "StepPrediction", "predict_step"]

Flops = Sequence[tuple[float, float]]
"""Per layer, the (forward, backward) FLOPs of the whole sample batch."""


@dataclass(frozen=True)
class StageTime:
    """What one stage spends over a step (all its micro-batches), in milliseconds."""

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
    """The all-reduce of its gradients over the replicas; 0 with ``dp=1``."""

    @property
    def busy_ms(self) -> float:
        """Compute time of the stage: F + B + W + recompute."""
        return self.forward_ms + self.input_grad_ms + self.weight_ms + self.recompute_ms


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step: its time, where the time goes, and the simulated timeline."""

    step_ms: float
    """One training step, from the first forward to the last gradient all-reduce's end."""
    pipeline_ms: float
    """The schedule's span: from the first forward to the last backward action's end."""
    bubble: float
    """Idle fraction of the workers over :attr:`pipeline_ms` (waiting for others or for
    transfers); ``(K-1)/(M+K-1)`` for GPipe and 1F1B with equal stages and free transfers."""
    busy_ms: tuple[float, ...]
    """Per worker, the time it computes (F, B, W, recompute)."""
    stages: tuple[StageTime, ...]
    """Per stage, the parts of its time."""
    exposed_allreduce_ms: float
    """The part of the step spent after :attr:`pipeline_ms` on gradient all-reduces."""
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
) -> StepPrediction:
    """Predict the time of one training step of ``profile`` split by ``balance``.

    Args:
        profile: a measured profile (``pipepar.profile(..., device="cuda:0")``), or any profile
            with ``flops``.
        balance: layers per stage; the virtual-stage schedules take two stages per worker.
        cluster: the machines (a :class:`~pipepar.planner.cluster.Cluster` or a preset name).
        schedule: a name of :data:`pipepar.core.schedule.NAMES` or a Schedule.
        chunks: micro-batches per mini-batch M.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        dp: data-parallel replicas of the pipeline, on devices after the first's.
        flops: per layer, (forward, backward) FLOPs of the whole batch; times are then estimated
            from the cluster's FLOP/s instead of read from the profile.
        weight_share: the share of a layer's backward that W runs when split off.

    Returns:
        The :class:`StepPrediction`.

    Raises:
        ValueError: no times (a ``meta`` profile without ``flops``), a balance that does not
            fit the profile or the schedule, more devices than the cluster has.

    Example:
        >>> pred = predict_step(prof, [2, 2], cluster="h100x8", schedule="zb-h1", chunks=8)
        >>> pred.step_ms > pred.stages[0].forward_ms
        True
    """
    machines = _check_cluster(cluster)
    stage_layers = _ranges(validation.check_balance(balance, len(profile)))
    chunks = validation.check_chunks(chunks)
    checkpoint = validation.check_checkpoint(checkpoint)
    _check_options(dp, weight_share)
    m = max(1, min(chunks, profile.batch_size))
    order = make(schedule, len(stage_layers), m, n_workers=n_workers(schedule, len(stage_layers)))
    _check_fits(machines, order.n_workers, dp)
    times = _layer_times(profile, machines, flops)
    model = _StepModel(profile, order, stage_layers, times, checkpoint, weight_share)
    return _predict(model, machines, dp, "measured" if flops is None else "flops")


# -- the per-action costs ----------------------------------------------------------------------
class _StepModel:
    """Each action's cost (ms) and each cut's bytes, for one schedule and balance."""

    def __init__(
        self,
        profile: Profile,
        order: Schedule,
        stage_layers: list[range],
        times: list[tuple[float, float]],
        checkpoint: str,
        weight_share: float,
    ) -> None:
        self.order, self.layers, self.checkpoint = order, stage_layers, checkpoint
        m, rows = order.n_microbatches, max(1, profile.batch_size)
        self.share = [(rows // m + (i < rows % m)) / rows for i in range(m)]
        self.f, self.b, self.w = [], [], []
        for s, span in enumerate(stage_layers):
            fwd = sum(times[i][0] for i in span)
            whole = sum(times[i][1] for i in span)
            layers = [profile.layers[i] for i in span]
            if not all(x.splits_backward for x in layers):
                weight = 0.0  # the runtime runs the whole backward in B
            elif s == 0:
                weight = whole  # the input needs no gradient: B computes nothing
            else:
                weight = weight_share * sum(times[x.index][1] for x in layers if x.grads_bytes)
            self.f.append(fwd)
            self.b.append(whole - weight)
            self.w.append(weight)
        self.grads = [sum(profile.layers[i].grads_bytes for i in span) for span in stage_layers]
        self.sent, self.returned = _cut_bytes(profile, [span.stop - 1 for span in stage_layers])

    def recompute(self, a: Action) -> float:
        checkpointed = should_checkpoint(self.checkpoint, a.microbatch, self.order.n_microbatches)
        return self.f[a.stage] * self.share[a.microbatch] if checkpointed else 0.0

    def cost(self, a: Action, split: bool) -> float:
        """The time of action ``a``; ``split``: whether the schedule runs a W after its B."""
        r, s = self.share[a.microbatch], a.stage
        if a.kind == "F":
            return self.f[s] * r
        if a.kind == "W":
            return self.w[s] * r if split else 0.0
        return self.recompute(a) + (self.b[s] if split else self.b[s] + self.w[s]) * r

    def transfer(
        self, devices: Sequence[int], cluster: Cluster
    ) -> Callable[[Action, Action], float]:
        """``transfer(dep, action)`` for a replica whose worker ``w`` is device ``devices[w]``."""
        place = self.order.placement

        def delay(dep: Action, a: Action) -> float:
            if place[dep.stage] == place[a.stage]:
                return 0.0  # same worker (or same stage): nothing moves
            cut = min(dep.stage, a.stage)
            nbytes = (self.sent if a.kind == "F" else self.returned)[cut]
            link = cluster.link(devices[place[dep.stage]], devices[place[a.stage]])
            return 1e3 * link.seconds(nbytes * self.share[a.microbatch])

        return delay


def _cut_bytes(profile: Profile, lasts: list[int]) -> tuple[list[float], list[float]]:
    """Per cut after layer ``lasts[s]``: bytes sent forward, and gradient bytes sent back.

    What enters layer ``b + 1`` is every storage made at or before ``b`` (the sample's at
    ``-1``) that an output at or after ``b`` refers to; the sample needs no gradient. A
    profile without storages (built by hand) has the layer's output only."""
    if not profile.storages:
        out = [float(profile.layers[b].output_bytes) for b in lasts]
        return out, list(out)
    sent, returned = [], []
    for b in lasts:
        crossing = [
            r
            for r in profile.storages
            if r.creator <= b and r.last_output is not None and r.last_output >= b
        ]
        sent.append(float(sum(r.nbytes for r in crossing)))
        returned.append(float(sum(r.nbytes for r in crossing if r.creator >= 0)))
    return sent, returned


# -- the simulation ----------------------------------------------------------------------------
def _predict(model: _StepModel, cluster: Cluster, dp: int, source: str) -> StepPrediction:
    order, k = model.order, model.order.n_workers
    runs = {
        r: timed(order, model.cost, transfer=model.transfer(_devices(r, k), cluster))
        for r in _distinct_replicas(cluster, k, dp)
    }
    pipeline = max(max(f.values(), default=0.0) for f in runs.values())
    ready = [max(_last_backward(f, s) for f in runs.values()) for s in range(order.n_stages)]
    reduce_ms = [_allreduce_ms(model, cluster, dp, s) for s in range(order.n_stages)]
    step = max([pipeline, *_allreduce_ends(order, ready, reduce_ms)])
    replica = max(runs, key=lambda r: max(runs[r].values(), default=0.0))
    busy = [0.0] * k
    for a in runs[replica]:
        busy[order.placement[a.stage]] += _cost(model, a)
    return StepPrediction(
        step_ms=step,
        pipeline_ms=pipeline,
        bubble=1.0 - sum(busy) / (pipeline * k) if pipeline > 0 else 0.0,
        busy_ms=tuple(busy),
        stages=tuple(
            _stage_time(model, cluster, replica, reduce_ms[s], s) for s in range(order.n_stages)
        ),
        exposed_allreduce_ms=step - pipeline,
        spans=_spans(model, runs[replica]),
        schedule=order.name,
        chunks=order.n_microbatches,
        dp=dp,
        cluster=cluster.name,
        source=source,
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


def _cost(model: _StepModel, a: Action) -> float:
    return model.cost(a, model.order.splits_backward(a.stage, a.microbatch))


def _last_backward(finish: dict[Action, float], s: int) -> float:
    """When stage ``s``'s gradients are final: the end of its last B or W."""
    return max((t for a, t in finish.items() if a.stage == s and a.kind != "F"), default=0.0)


def _allreduce_ms(model: _StepModel, cluster: Cluster, dp: int, s: int) -> float:
    """Ring all-reduce of stage ``s``'s gradients over the ``dp`` replicas."""
    if dp == 1 or model.grads[s] == 0:
        return 0.0
    k, w = model.order.n_workers, model.order.placement[s]
    link = cluster.ring([r * k + w for r in range(dp)])
    steps = 2 * (dp - 1)  # reduce-scatter, then all-gather: dp - 1 messages each
    return 1e3 * (steps / dp * model.grads[s] / link.bandwidth + steps * link.latency)


def _allreduce_ends(order: Schedule, ready: list[float], took: list[float]) -> list[float]:
    """Each stage's all-reduce end; a worker's all-reduces run one after another, in the order
    its stages' gradients become final."""
    ends = []
    for w in range(order.n_workers):
        free = 0.0
        for s in sorted(order.stages_of(w), key=lambda s: ready[s]):
            free = max(free, ready[s]) + took[s]
            ends.append(free)
    return ends


def _stage_time(
    model: _StepModel, cluster: Cluster, replica: int, reduce: float, s: int
) -> StageTime:
    order = model.order
    actions = order.stage(s)
    recompute = sum(model.recompute(a) for a in actions if a.kind == "B")
    backward = sum(_cost(model, a) for a in actions if a.kind == "B")
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
        forward_ms=float(sum(_cost(model, a) for a in actions if a.kind == "F")),
        input_grad_ms=backward - recompute,
        weight_ms=float(sum(_cost(model, a) for a in actions if a.kind == "W")),
        recompute_ms=recompute,
        transfer_ms=moved,
        allreduce_ms=reduce,
    )


def _spans(
    model: _StepModel, finish: dict[Action, float]
) -> tuple[tuple[Action, float, float], ...]:
    spans = [(a, end - _cost(model, a), end) for a, end in finish.items()]
    return tuple(sorted(spans, key=lambda x: (x[1], model.order.placement[x[0].stage])))


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


def _check_fits(cluster: Cluster, k: int, dp: int) -> None:
    if k * dp > cluster.devices:
        nodes = -(-k * dp // cluster.devices_per_node)
        raise ValueError(
            f"{k} workers x dp={dp} need {k * dp} devices but cluster {cluster.name!r} has "
            f"{cluster.devices} ({cluster.nodes} node(s) of {cluster.devices_per_node}); pass "
            f"a cluster with nodes={nodes}, e.g. Cluster.named({cluster.name!r}, nodes={nodes})"
        )
