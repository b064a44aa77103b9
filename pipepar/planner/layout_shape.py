"""The shapes a layout search tries: every pipeline degree of the devices, its replicas
replicated or sharded, each with the profile scaled to a replica's rows.

For ``N`` devices and a global batch of ``G`` rows, every ``N = pp x dp`` is a candidate: ``dp``
replicas of a pipeline over ``pp`` devices, each replica taking ``G / dp`` rows per step
(:func:`~pipepar.planner.profile_rows.at_rows` scales the profile, linearly, as the planner
scales a batch to its micro-batches). A profile without times (on ``meta``) takes them from
FLOP counts at the cluster's rate, so the balance minimizes the slowest stage's time there
too. A sharded shape's memory is one rank's of its shard group
(:func:`~pipepar.planner.sharded_state.sharded`); its step is timed unsharded.

Ruled out exactly, each with the reason kept for the search's message: a ``pp`` with more
stages than layers, a ``dp`` that does not divide the batch, one whose replicas take fewer
rows than any micro-batch count, and a shape whose parameters, gradients and optimizer state
alone exceed its ``pp`` devices.

    >>> shapes = Shapes(prof, flops, cluster, capacity, devices=8, rows=512, chunks=[8, 4],
    ...                 shards=[False, True], skipped=[])
    >>> [(s.pp, s.dp, s.shard) for s in shapes]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from pipepar.core.units import format_bytes
from pipepar.planner.cluster import Cluster
from pipepar.planner.plan_targets import Target, resolve_targets
from pipepar.planner.profile import Profile
from pipepar.planner.profile_rows import at_rows
from pipepar.planner.sharded_state import sharded
from pipepar.planner.step_time import Flops

__all__ = ["Shape", "Shapes", "with_times"]


@dataclass(frozen=True)
class Shape:
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


class Shapes:
    """The shapes of ``devices`` devices and a batch of ``rows``, built as they are walked.

    Args:
        prof: the profile, of any batch.
        flops: per layer, the (forward, backward) FLOPs of the profile's batch, for a profile
            without times; None: its times as they are.
        cluster: the machines (their FLOP rate times a profile without times).
        capacity: bytes per device.
        devices: all devices, N.
        rows: the global batch G.
        chunks: the micro-batch counts tried, largest first.
        shards: whether to try each stage's state replicated (False) and sharded (True).
        skipped: where to say why a shape is not tried (the search's list of reasons, which
            it extends with the schedules it does not try).
    """

    def __init__(
        self,
        prof: Profile,
        flops: Flops | None,
        cluster: Cluster,
        capacity: int,
        *,
        devices: int,
        rows: int,
        chunks: list[int],
        shards: list[bool],
        skipped: list[str],
    ) -> None:
        self.prof, self.flops, self.cluster, self.capacity = prof, flops, cluster, capacity
        self.devices, self.rows, self.chunks, self.shards = devices, rows, chunks, shards
        self.skipped = skipped
        self.tried: dict[tuple[int, bool], tuple[int, int]] = {}  # (pp, shard) -> (dp, rows)
        self.statics: dict[tuple[int, bool], int] = {}  # (dp, shard) -> state bytes, all layers

    def __iter__(self) -> Iterator[Shape]:
        for pp in (d for d in range(1, self.devices + 1) if self.devices % d == 0):
            dp = self.devices // pp
            rows = self.rows // dp
            if pp > len(self.prof):
                self.skipped.append(f"pp={pp}: more devices than the {len(self.prof)} layers")
            elif self.rows % dp:
                self.skipped.append(f"dp={dp}: does not divide the batch of {self.rows} rows")
            elif rows < self.chunks[-1]:
                self.skipped.append(f"dp={dp}: {rows} rows per replica, fewer than any chunks")
            else:
                yield from self._variants(pp, dp, rows)

    def _variants(self, pp: int, dp: int, rows: int) -> Iterator[Shape]:
        """The pipeline degree replicated and sharded, those asked for (sharded: ``dp >= 2``),
        but not one whose parameters, gradients and optimizer state alone do not fit."""
        for shard in self.shards:
            if shard and dp == 1:
                if False not in self.shards:
                    self.skipped.append(f"pp={pp}: dp=1, no replicas to shard over")
                continue
            self.tried[(pp, shard)] = (dp, rows)
            static = math.ceil(self.state_bytes(dp, shard) / pp)
            if static > self.capacity:
                self.skipped.append(
                    f"pp={pp}{_sharded(shard, dp)}: parameters, gradients and optimizer state "
                    f"alone take {format_bytes(static)} per device"
                )
            else:
                yield self.shape(pp, dp, rows, shard)

    def state_bytes(self, dp: int, shard: bool) -> int:
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

    def shape(self, pp: int, dp: int, rows: int, shard: bool) -> Shape:
        """The shape of ``dp`` replicas of ``pp`` devices, ``rows`` each, sharded or not."""
        scaled = at_rows(self.prof, rows)
        r = rows / self.prof.batch_size
        flops = None if self.flops is None else [(f * r, b * r) for f, b in self.flops]
        if flops is not None:  # times for the balance, as predict_step reckons them
            scaled = with_times(scaled, flops, self.cluster)
        targets = resolve_targets(pp, self.capacity, layers=len(scaled))
        memory = sharded(scaled, dp) if shard else scaled
        return Shape(pp, dp, rows, memory, flops, targets, shard, scaled)

    def chunk_counts(self, shape: Shape) -> list[int]:
        """The micro-batch counts to try for a replica of ``shape``, largest first."""
        return [c for c in self.chunks if c <= shape.rows]


def with_times(prof: Profile, flops: Flops, cluster: Cluster) -> Profile:
    """``prof`` with each layer's times from its FLOPs at the cluster's rate."""
    rate = cluster.flops * cluster.efficiency / 1e3  # FLOP per ms
    layers = [
        replace(layer, forward_ms=f / rate, backward_ms=b / rate)
        for layer, (f, b) in zip(prof.layers, flops)
    ]
    return replace(prof, layers=layers)


def _sharded(shard: bool, dp: int) -> str:
    """`` sharded over its dp=n replicas`` for a sharded shape, for messages; else nothing."""
    return f" sharded over its dp={dp} replicas" if shard else ""
