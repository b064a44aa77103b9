"""Lower bounds of a layout's step, cheaper than predicting it: what lets the layout search
skip what cannot make its ``top``.

Before a plan: a replica's work spread evenly over its devices with no bubble
(:func:`work_bound`). Once a plan fits: its busiest device's compute (:func:`busy_bound`).
Either way some device does at least that share of the step's work, so a step at least as
long cannot be shorter than the bound.

    >>> if busy_bound(plan, runtime) <= threshold:
    ...     prediction = predict_step(...)
"""

from __future__ import annotations

from pipepar.planner.plan import Plan
from pipepar.planner.profile import Profile
from pipepar.planner.runtime_fit import RuntimeFit

__all__ = ["busy_bound", "recomputed_share", "work_bound"]


def recomputed_share(checkpoint: str, m: int) -> float:
    """The share of ``m`` micro-batches whose forward recompute policy ``checkpoint`` runs
    again (``"except_last"``: all but the last)."""
    return {"never": 0.0, "except_last": (m - 1) / m, "always": 1.0}[checkpoint]


def work_bound(prof: Profile, pp: int, fewest: int, checkpoint: str) -> float:
    """A replica's work spread evenly over its ``pp`` devices with no bubble (ms), at the
    ``fewest`` micro-batches tried (the fewest recomputed): a lower bound of the step, as some
    device does its share."""
    layers = prof.layers
    work = sum((x.forward_ms or 0.0) + (x.backward_ms or 0.0) for x in layers)
    share = recomputed_share(checkpoint, fewest)
    return (work + share * sum(x.forward_ms or 0.0 for x in layers)) / pp


def busy_bound(found: Plan, runtime: RuntimeFit | None) -> float:
    """The busiest device's compute over the step (ms), a lower bound of the step: its
    stages' forward and backward, and the forwards run again for checkpointed micro-batches
    (each scaled as the runtime's fit scales it)."""
    fit = runtime or RuntimeFit()
    m = found.chunks
    share = recomputed_share(found.checkpoint, m)
    busy: dict[int, float] = {}
    for s in found.stages:
        forward = sum(found.layers[i].forward_ms or 0.0 for i in s.layers)
        again = m * share * fit.recompute(forward / m, len(s.layers))
        work = fit.scale * (s.time_ms or 0.0) + again
        busy[s.worker] = busy.get(s.worker, 0.0) + work
    return max(busy.values())
