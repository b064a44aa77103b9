"""A predicted step as text: one line per worker, a character per slice of the step.

It reads a :class:`~pipepar.planner.step_time.StepPrediction`'s actions (plain data) and
draws what each worker runs over the step (``F`` forward, ``B`` backward, ``W`` weight
gradients, ``r`` recompute, ``g`` the weights' all-gather, ``a`` all-reduce, ``s``
reduce-scatter, ``.`` idle), with its busy time and its idle share of the pipeline span.
:func:`pipepar.render.report.render_report` prints it under the predicted step.

    >>> print("\\n".join(gantt_lines(layouts[0].prediction, width=60)))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipepar.planner.predicted_actions import PredictedAction
    from pipepar.planner.step_time import StepPrediction

__all__ = ["LETTERS", "gantt_lines"]

LETTERS = {
    "F": "F",
    "B": "B",
    "W": "W",
    "recompute": "r",
    "all-gather": "g",
    "all-reduce": "a",
    "reduce-scatter": "s",
}
"""The character of each kind of predicted action; ``.`` is idle."""

_NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradients",
    "recompute": "recompute",
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
}

_PRIORITY = ("recompute", "F", "B", "W", "all-gather", "reduce-scatter", "all-reduce")
"""Which kind a slice shows when several cover it: a recompute inside its B, compute over a
collective running beside it."""


def gantt_lines(prediction: StepPrediction, *, width: int = 60) -> list[str]:
    """A heading and one line per worker: the step in ``width`` characters, busy and idle.

    Each character shows what the worker runs at the middle of its slice of the step.

    Raises:
        ValueError: ``width`` below 10.

    Example:
        >>> gantt_lines(pred, width=10)[1]  # 10 ms: an all-gather, F, idle, B, reduce-scatter
        'worker 0 |gFF.....Bs| busy 3 ms, idle 66.7% of the pipeline span'
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 10:
        raise ValueError(f"width must be an int >= 10 characters, got {width!r}; e.g. 60")
    step = prediction.step_ms
    if not prediction.actions or step <= 0:
        return []
    cell = step / width
    keys = ", ".join(f"{c} {_NAMES[k]}" for k, c in LETTERS.items() if _present(prediction, k))
    lines = [f"predicted timeline, one character = {_ms(cell)} ({keys}, . idle):"]
    workers = len(prediction.busy_ms)
    label = len(f"worker {workers - 1}")
    for w in range(workers):
        mine = [a for a in prediction.actions if a.worker == w]
        bar = "".join(_letter(mine, (i + 0.5) * cell) for i in range(width))
        busy = prediction.busy_ms[w]
        span = prediction.pipeline_ms
        idle = 1.0 - busy / span if span > 0 else 0.0
        name = f"worker {w}".ljust(label)
        lines.append(f"{name} |{bar}| busy {_ms(busy)}, idle {idle:.1%} of the pipeline span")
    return lines


def _present(prediction: StepPrediction, kind: str) -> bool:
    return any(a.kind == kind for a in prediction.actions)


def _letter(actions: Sequence[PredictedAction], t: float) -> str:
    """What runs at time ``t`` (ms): the first of :data:`_PRIORITY` covering it, or idle."""
    covering = {a.kind for a in actions if a.start_ms <= t < a.end_ms}
    kind = next((k for k in _PRIORITY if k in covering), None)
    return "." if kind is None else LETTERS[kind]


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 1000 else f"{value / 1e3:.3g} s"
