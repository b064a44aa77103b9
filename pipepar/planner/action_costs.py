"""What each action of a predicted step costs: a stage's forward, input-gradient, weight-gradient
and recompute time per micro-batch, and the bytes each cut hands over.

:class:`StepModel` reads a profile's layer times (measured, or from FLOPs) for one schedule and
balance; a layer's time on a micro-batch is its part per call plus its share of the rows of the
rest (:mod:`pipepar.planner.call_times`). The action that makes a micro-batch's parameter
gradients (W where the schedule splits the backward, else B) also adds them into the sums of
the micro-batches before it, at the device's memory bandwidth (none for the first). A
:class:`~pipepar.planner.runtime_fit.RuntimeFit` then scales each action and adds the
runtime's time per action. :mod:`pipepar.planner.step_time` runs the schedule's action lists
with these costs.

    >>> costs = StepModel(prof, order, [range(0, 2), range(2, 4)], times, "never", 0.5,
    ...                   per_call=True)
    >>> costs.cost(order.stage(0)[0], split=False)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipepar.core.recompute import should_checkpoint
from pipepar.core.schedule import Action, Schedule
from pipepar.planner.call_times import at_share
from pipepar.planner.cluster import Cluster
from pipepar.planner.profile import LayerProfile, Profile
from pipepar.planner.runtime_fit import RuntimeFit

__all__ = ["StepModel", "cut_bytes"]


@dataclass(frozen=True)
class _Part:
    """Work of the whole batch (ms) of which ``call`` each call costs whatever its rows
    (:mod:`pipepar.planner.call_times`)."""

    whole: float
    call: float

    def at(self, share: float) -> float:
        """The time of a call on ``share`` of the batch's rows."""
        return at_share(self.whole, self.call, share)

    def times(self, k: float) -> _Part:
        return _Part(k * self.whole, k * self.call)

    def minus(self, other: _Part) -> _Part:
        return _Part(self.whole - other.whole, self.call - other.call)


def _part(
    times: list[tuple[float, float]], layers: Sequence[LayerProfile], d: int, per_call: bool
) -> _Part:
    """Direction ``d`` (0: forward, 1: backward) of ``layers``: their times, and the part each
    call costs when ``per_call`` (measured times; those from FLOPs have none)."""
    calls = [x.forward_call_ms if d == 0 else x.backward_call_ms for x in layers]
    if not per_call:
        calls = [0.0] * len(layers)
    whole = [times[x.index][d] for x in layers]
    return _Part(sum(whole), sum(min(c, t) for c, t in zip(calls, whole)))


class StepModel:
    """Each action's cost (ms) and each cut's bytes, for one schedule and balance."""

    def __init__(
        self,
        profile: Profile,
        order: Schedule,
        stage_layers: list[range],
        times: list[tuple[float, float]],
        checkpoint: str,
        weight_share: float,
        *,
        per_call: bool,
        runtime: RuntimeFit | None = None,
        memory_bandwidth: float | None = None,
    ) -> None:
        self.order, self.layers, self.checkpoint = order, stage_layers, checkpoint
        self.runtime = runtime or RuntimeFit()
        m, rows = order.n_microbatches, max(1, profile.batch_size)
        self.share = [(rows // m + (i < rows % m)) / rows for i in range(m)]
        self.f: list[_Part] = []
        self.b: list[_Part] = []
        self.w: list[_Part] = []
        for s, span in enumerate(stage_layers):
            layers = [profile.layers[i] for i in span]
            fwd = _part(times, layers, 0, per_call)
            whole = _part(times, layers, 1, per_call)
            if s == 0:
                weight = whole  # the input needs no gradient: B computes nothing, W all
            elif not all(x.splits_backward for x in layers):
                weight = _Part(0.0, 0.0)  # the runtime runs the whole backward in B
            else:
                weight = _part(times, [x for x in layers if x.grads_bytes], 1, per_call)
                weight = weight.times(weight_share)
            self.f.append(fwd)
            self.b.append(whole.minus(weight))
            self.w.append(weight)
        self.grads = [sum(profile.layers[i].grads_bytes for i in span) for span in stage_layers]
        self.sums = [
            _sum_ms([profile.layers[i] for i in span], memory_bandwidth) for span in stage_layers
        ]
        self.params = [sum(profile.layers[i].params_bytes for i in span) for span in stage_layers]
        self.sent, self.returned = cut_bytes(profile, [span.stop - 1 for span in stage_layers])
        self.extra: Mapping[Action, float] = {}
        """Per action, time added to it (ms): activation offload's copies
        (:mod:`pipepar.planner.offload_time`)."""

    def recompute(self, a: Action) -> float:
        checkpointed = should_checkpoint(self.checkpoint, a.microbatch, self.order.n_microbatches)
        if not checkpointed:
            return 0.0
        forward = self.f[a.stage].at(self.share[a.microbatch])
        return self.runtime.recompute(forward, len(self.layers[a.stage]))

    def cost(self, a: Action, split: bool) -> float:
        """The time of action ``a``; ``split``: whether the schedule runs a W after its B.
        The runtime's fit applies to each (a W that does not run costs nothing); then
        :attr:`extra` is added."""
        return self.own(a, split) + self.extra.get(a, 0.0)

    def own(self, a: Action, split: bool) -> float:
        """The time of action ``a`` without :attr:`extra`."""
        r, s, run = self.share[a.microbatch], a.stage, self.runtime
        n = len(self.layers[s])
        if a.kind == "F":
            return run.action(self.f[s].at(r), n)
        summed = self.sums[s] if a.microbatch > 0 else 0.0  # the first one's is the sum
        if split and self.w[s].whole > 0:  # W makes the parameter gradients
            if a.kind == "W":
                return run.weight(self.w[s].at(r) + summed)
            return self.recompute(a) + run.action(self.b[s].at(r), n)
        if a.kind == "W":
            return 0.0  # B did it all
        backward = self.b[s].at(r) + self.w[s].at(r) + summed
        return self.recompute(a) + run.action(backward, n)

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
            moved = 1e3 * link.seconds(nbytes * self.share[a.microbatch])
            return moved + self.runtime.handover_ms

        return delay


def _sum_ms(layers: Sequence[LayerProfile], bandwidth: float | None) -> float:
    """Adding a micro-batch's parameter gradients into their sums (ms): two reads and a write
    of each gradient; a matrix product's weight gradient, summed in its product, reads and
    writes the sum only. 0 where the memory bandwidth is unknown."""
    if not bandwidth:
        return 0.0
    direct = sum(min(x.direct_grad_bytes, x.grads_bytes) for x in layers)
    moved = 3 * sum(x.grads_bytes for x in layers) - direct
    return 1e3 * moved / bandwidth


def cut_bytes(profile: Profile, lasts: list[int]) -> tuple[list[float], list[float]]:
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
