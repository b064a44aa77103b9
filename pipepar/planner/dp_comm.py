"""The data-parallel collectives of a predicted step: how long each takes and when it runs.

Worker ``w`` of replica ``r`` is device ``r * K + w``, so the ``dp`` replicas of a pipeline
position form a ring over devices ``w, K + w, 2K + w, ...``, timed on its slowest link
(:meth:`~pipepar.planner.cluster.Cluster.ring`) with ``n = dp``:

- **all-reduce** (replicated, ``dp_shard=False``): ``2 (n-1)/n * bytes / bandwidth +
  2 (n-1) * latency``, a reduce-scatter then an all-gather;
- **all-gather** and **reduce-scatter** (sharded, ``dp_shard=True``): half of that,
  ``(n-1)/n * bytes / bandwidth + (n-1) * latency``.

A sharded worker gathers all its stages' weights at once, at the step's start, and runs no
action before the gather ends (``timed(..., start=...)``); a stage's gradients are reduced once they
are final on every replica, one collective after another on a worker
(:func:`reduce_spans`). :mod:`pipepar.planner.step_time` puts them together.

    >>> ring_ms(cluster, [0, 8], 2**30, passes=1)   # one GiB gathered over two nodes
"""

from __future__ import annotations

from collections.abc import Sequence

from pipepar.core.schedule import Schedule
from pipepar.planner.cluster import Cluster

__all__ = ["position", "reduce_spans", "ring_ms"]


def ring_ms(cluster: Cluster, devices: Sequence[int], nbytes: float, *, passes: int) -> float:
    """A ring collective of ``nbytes`` over ``devices`` (ms): ``passes`` = 1 for an all-gather
    or a reduce-scatter, 2 for an all-reduce; 0 for one device or nothing to move.

    Example:
        >>> ring_ms(Cluster.named("h100x8"), [0, 1], 0, passes=2)
        0.0
    """
    n = len(devices)
    if n < 2 or nbytes <= 0:
        return 0.0
    link = cluster.ring(list(devices))
    steps = passes * (n - 1)  # n - 1 messages per pass, each 1/n of the bytes
    return 1e3 * (steps / n * nbytes / link.bandwidth + steps * link.latency)


def position(k: int, dp: int, w: int) -> list[int]:
    """The devices of pipeline position ``w`` over the ``dp`` replicas of ``k`` workers."""
    return [r * k + w for r in range(dp)]


def reduce_spans(
    order: Schedule, ready: Sequence[float], took: Sequence[float]
) -> list[tuple[int, float, float]]:
    """Each stage's gradient collective as (stage, start, end): it starts once the stage's
    gradients are final (``ready[s]``) and its worker's earlier collective has ended; a
    worker's run one after another, in the order their stages' gradients become final."""
    spans = []
    for w in range(order.n_workers):
        free = 0.0
        for s in sorted(order.stages_of(w), key=lambda s: ready[s]):
            start = max(free, ready[s])
            free = start + took[s]
            spans.append((s, start, free))
    return spans
