"""The predicted timeline of one step as plain data: who runs what, and when.

:func:`~pipepar.planner.step_time.predict_step` simulates the schedule's action lists; each
action of the slowest replica, and each data-parallel collective, becomes a
:class:`PredictedAction`. They are data: :meth:`PredictedAction.to_dict` is what the plan's
JSON holds, and the renderers draw them (:mod:`pipepar.planner.predicted_timeline` turns them
into the :class:`~pipepar.recording.tracer.Timeline` shape the measured timeline has).

    >>> pred = predict_step(prof, [4, 4], cluster="h100x8", chunks=8, dp=2, dp_shard=True)
    >>> [(a.worker, a.kind, a.start_ms) for a in pred.actions[:2]]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["COLLECTIVES", "COMPUTE_KINDS", "KINDS", "PredictedAction"]

COMPUTE_KINDS = ("F", "B", "W")
"""A schedule's actions: forward, backward (input gradients; all of it where W does not split
it off) and the weight gradients split off it."""

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter")
"""The data-parallel collectives: the weights' all-gather before a sharded worker's first
action, and the gradients' all-reduce (replicated) or reduce-scatter (sharded) at the end."""

KINDS = (*COMPUTE_KINDS, "recompute", *COLLECTIVES)
"""Every kind of :class:`PredictedAction`; ``"recompute"`` runs at the start of its ``"B"``,
inside it."""


@dataclass(frozen=True)
class PredictedAction:
    """One span of the predicted step on one worker, in milliseconds from the step's start.

    Example:
        >>> PredictedAction(0, 0, "F", 3, 1.5, 2.0).to_dict()["kind"]
        'F'
    """

    worker: int
    """The worker (device of a pipeline) that runs it."""
    stage: int | None
    """The stage; None for an all-gather, which gathers all the worker's stages at once."""
    kind: str
    """One of :data:`KINDS`."""
    microbatch: int | None
    """The micro-batch; None for a collective (it covers the whole step)."""
    start_ms: float
    """When it starts, from the step's start (ms)."""
    end_ms: float
    """When it ends (ms)."""

    @property
    def duration_ms(self) -> float:
        """``end_ms - start_ms``."""
        return self.end_ms - self.start_ms

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)
