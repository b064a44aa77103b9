"""What a rank holds of its messages at a moment of the schedule: receives posted ahead.

In one process a value crossing a stage boundary is handed over; across ranks
(``pipepar.distributed``) it arrives in a buffer the receiving rank allocated when it posted
the receive, and a receive is posted before its message so that the peer's send finds it
waiting. Those buffers are memory the stages' own figures do not count: the input of a stage
and the gradient of its output are counted from the moment its action takes them, not from
the moment their receive was posted. Which receives are posted early depends on the runtime:

- any model (``RankProgram``, the model's own ``forward`` on every rank): where every stage
  runs its backwards in the order of its forwards (:meth:`Schedule.in_order
  <pipepar.core.schedule.Schedule.in_order>`), a stage that sends its output to another
  rank posts the receive of that output's gradient as the value leaves. So a stage holds one
  gradient buffer per micro-batch whose forward ran and whose backward has not begun; the
  backward that begins takes its own as the incoming gradient (counted by its figures);
- an ``nn.Sequential`` chain (``RankChain``): each channel posts one receive ahead, the input
  of the stage's next forward once a forward ran, and the gradient of its next backward once
  a backward ran.

Measured on transformers' GPT-2 across 2 ranks (``benchmarks/RESULTS.md``, "Memory-saving
schedules on transformers' GPT-2 (analysis)"): at the rank's peak, the gradient receives
posted were what :class:`PostedReceives` counts for the program (one or two micro-batches'
hidden states). A rank's own stages never message each other (handed over in memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipepar.core.schedule import Schedule
from pipepar.planner.peak_moments import Moment

__all__ = ["CHAIN", "PROGRAM", "RUNTIMES", "PostedReceives", "Receives", "receives_of"]


@dataclass(frozen=True)
class Receives:
    """How a runtime across ranks posts receives before their messages arrive.

    Attributes:
        per_unanswered: a receive of the output's gradient for each micro-batch whose
            forward ran and whose backward has not begun (only where the schedule runs each
            stage's backwards in the order of its forwards).
        ahead: one receive ahead per channel: the next forward's input, the next backward's
            gradient.
    """

    per_unanswered: bool
    ahead: bool


PROGRAM = Receives(per_unanswered=True, ahead=False)
CHAIN = Receives(per_unanswered=False, ahead=True)
RUNTIMES = {"program": PROGRAM, "chain": CHAIN}
"""The runtimes across ranks by name: ``"program"`` (any model), ``"chain"`` (an
``nn.Sequential``)."""


def receives_of(ranks: str | None) -> Receives | None:
    """The receives of runtime ``ranks`` (:data:`RUNTIMES`), None in one process.

    Raises:
        ValueError: an unknown name.
    """
    if ranks is None:
        return None
    if ranks not in RUNTIMES:
        raise ValueError(
            f"ranks must be None (one process) or one of {sorted(RUNTIMES)}, got {ranks!r}; "
            "pass ranks='program' for pipepar.distributed on any model, 'chain' on an "
            "nn.Sequential"
        )
    return RUNTIMES[ranks]


class PostedReceives:
    """The receive buffers each worker of ``schedule`` has posted, by moment.

    Args:
        receives: how the runtime posts them.
        schedule: the schedule (its placement says which boundaries cross ranks).

    Example:
        >>> from pipepar.core.named_schedules import make
        >>> from pipepar.planner.peak_moments import moments
        >>> s = make("1f1b", 2, 4, n_workers=2)
        >>> posted = PostedReceives(PROGRAM, s)
        >>> walk = moments(s, 0, "never", splits=(True,))
        >>> [(m.kind, posted.bytes(0, m, [(0, 10)])) for m in walk][:3]
        [('forward', 20), ('backward', 10), ('backward_end', 10)]
    """

    def __init__(self, receives: Receives, schedule: Schedule) -> None:
        self.receives, self.schedule = receives, schedule
        self.early = receives.per_unanswered and schedule.in_order()

    def bytes(self, w: int, m: Moment, edges: Sequence[tuple[int, int] | None]) -> int:
        """Bytes of the receive buffers worker ``w`` has posted at moment ``m``
        (:func:`pipepar.planner.peak_moments.moments`); ``edges``: per stage of ``w``
        (``stages_of`` order; None: not counted), the bytes of one micro-batch's input and
        output at its boundaries."""
        if m.kind == "optimizer":
            return 0
        schedule, ahead = self.schedule, self.receives.ahead
        stages, place, last = schedule.stages_of(w), schedule.placement, schedule.n_stages - 1
        total = 0
        for at, edge in enumerate(edges):
            if edge is None:
                continue
            s, (inputs, output) = stages[at], edge
            if s < last and place[s + 1] != w:  # its output goes to another rank
                total += (m.unanswered[at] if self.early else 0) * output
                total += (m.grads_ahead[at] if ahead else 0) * output
            if s > 0 and place[s - 1] != w and ahead:  # its input comes from one
                total += m.inputs_ahead[at] * inputs
        return total
