"""Weight-gradient actions (W) run early, while a rank waits for another rank's gradients.

A rank runs its actions in the schedule's order. Where a backward (B) must wait for gradients
from another rank, the time is lost unless something else can run. A W action only needs its
own micro-batch's B to have run, so the rank may run the next W of its list now instead of
later. This changes no result, bit for bit, when:

* the W actions keep their order: the one run early is always the first W of the list not yet
  run, so every parameter's gradient is summed in the same order;
* the waiting B computes no weight gradient (its W does the whole backward: the caller asks
  :meth:`~pipepar.program.ranks.RankStep.defers_weights` first), so moving a W before it moves
  no sum past another.

Only the timing changes: a B that waits (measured: the first stage of a GPT-2 under zb-v waits
for the next rank's gradients about 1.7 ms per micro-batch) runs a W instead, and the B runs
once it is done. Nothing waits for the first stage's B, so the delay it takes costs nothing;
the W it ran would have been run later anyway.

``PIPEPAR_EARLY_WEIGHTS=0`` keeps the schedule's order exactly (for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from pipepar.core import switches
from pipepar.core.schedule import Action

__all__ = ["EarlyWeights", "enabled"]


def enabled() -> bool:
    """Whether W actions may run early (``PIPEPAR_EARLY_WEIGHTS`` is not ``"0"``)."""
    return switches.early_weights()


class EarlyWeights:
    """Which of a rank's W actions ran early, over one mini-batch's list of ``actions``."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self._actions = actions
        self._weights = [k for k, a in enumerate(actions) if a.kind == "W"]
        self._next = 0  # index into _weights of the first W not yet run early or reached
        self._ran: set[int] = set()
        self._backward_at = {
            (a.stage, a.microbatch): k for k, a in enumerate(actions) if a.kind == "B"
        }
        """Each B's position: the walk runs B actions in order, so those before ``k`` ran."""
        self.count = 0
        """How many W actions ran early in this mini-batch (a figure for tests)."""

    def ran(self, k: int) -> bool:
        """Whether action ``k`` already ran early (the walk skips it)."""
        return k in self._ran

    def while_waiting(self, k: int, arrived: Callable[[], bool]) -> Iterator[tuple[int, Action]]:
        """The W actions (with their positions) to run before action ``k`` (a B that defers
        its weights), one at a time, while ``arrived()`` says its gradients are not here:
        each the first W after ``k`` not yet run, as long as its own B has run (stands
        before ``k``)."""
        while not arrived():
            w = self._first_after(k)
            if w is None:
                return
            action = self._actions[w]
            if self._backward_at.get((action.stage, action.microbatch), k) >= k:
                return
            self._ran.add(w)
            self.count += 1
            yield w, action

    def _first_after(self, k: int) -> int | None:
        weights = self._weights
        while self._next < len(weights) and (
            weights[self._next] < k or weights[self._next] in self._ran
        ):
            self._next += 1
        return weights[self._next] if self._next < len(weights) else None
