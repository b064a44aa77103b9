"""A predicted step in the shape of a measured one: a :class:`~pipepar.recording.tracer.Timeline`.

The renderers draw a run recorded with ``trace=True`` (:mod:`pipepar.render.timeline`,
:func:`pipepar.render.timeline_html.section`); :func:`predicted_timeline` turns a
:class:`~pipepar.planner.step_time.StepPrediction`'s actions into the same events, so the
predicted step is drawn the same way: one lane per stage, F as ``"forward"``, B as
``"backward"``, W as ``"weight"``, a recompute inside its backward, and the data-parallel
collectives as events of their own kinds (``"all-gather"``, ``"all-reduce"``,
``"reduce-scatter"``; a worker's all-gather on each of its stages' lanes). Data only: the
renderers read it, it names no renderer.

    >>> timeline = predicted_timeline(layouts[0].prediction)
    >>> timeline.span * 1e3 == layouts[0].step_ms
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipepar.planner.predicted_actions import PredictedAction
from pipepar.recording.tracer import Event, Timeline

if TYPE_CHECKING:
    from pipepar.planner.step_time import StepPrediction

__all__ = ["EVENT_KINDS", "predicted_timeline"]

EVENT_KINDS = {
    "F": "forward",
    "B": "backward",
    "W": "weight",
    "recompute": "recompute",
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
}
"""The event kind of each :data:`~pipepar.planner.predicted_actions.KINDS`."""


def predicted_timeline(prediction: StepPrediction) -> Timeline:
    """The prediction's actions as a timeline, times in seconds from the step's start.

    Raises:
        ValueError: the prediction has no actions (one built by hand).
    """
    if not prediction.actions:
        raise ValueError(
            "the prediction has no actions to draw; make it with predict_step (or a layout "
            "search), which records the simulated timeline"
        )
    lanes: dict[int, list[int]] = {}
    for st in prediction.stages:
        lanes.setdefault(st.worker, []).append(st.index)
    events = [e for a in prediction.actions for e in _events(a, lanes)]
    return Timeline(events, origin=0.0)


def _events(a: PredictedAction, lanes: dict[int, list[int]]) -> list[Event]:
    """``a`` on its stage's lane; an all-gather (every stage of its worker) on each of them."""
    stages = lanes.get(a.worker, [a.worker]) if a.stage is None else [a.stage]
    kind = EVENT_KINDS[a.kind]
    mb = 0 if a.microbatch is None else a.microbatch
    return [Event(s, mb, kind, a.start_ms / 1e3, a.end_ms / 1e3) for s in stages]
