"""How a rank's walk over a model's stages moves on (the carrier of a model across ranks).

:func:`pipepar.core.executor.walk` runs the rank's list of actions through
:class:`~pipepar.program.ranks.RankStep` (the compute). The values cross where the model's own
forward makes them (the cut and its link), so the actions take and give empty order tokens;
what this carrier adds to the walk is timing:

* each action is reported to the mesh's :class:`~pipepar.ranks.progress.Progress` as it starts
  (after any weight gradients run early in front of it);
* at a backward action, a micro-batch's forward is let run on through the stages before the
  rank's first own stage (``ahead``: the driver's walk through others' code overlaps the
  backward);
* a backward that waits for another rank's gradients runs this rank's next ``W`` meanwhile
  (:mod:`pipepar.program.early_weights`), and the walk skips that ``W`` when it reaches it;
* a failure aborts the mini-batch's drivers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from pipepar.core.schedule import Action
from pipepar.program.early_weights import EarlyWeights
from pipepar.program.ranks import RankStep
from pipepar.program.step import Batch
from pipepar.ranks.progress import Progress, describe

__all__ = ["ProgramCarrier"]


class ProgramCarrier:
    """The order of one mini-batch's actions on this rank.

    Args:
        batch: the mini-batch's drivers.
        steps: this rank's stages' steps.
        progress: where the rank reports what it runs.
        ahead: by position in the walked list, the micro-batch whose forward is let run on
            to ``first`` there.
        first: the rank's first own stage.
        early: which W ran early (None: each W runs where listed).
    """

    def __init__(
        self,
        batch: Batch,
        steps: Mapping[int, RankStep],
        progress: Progress,
        ahead: Mapping[int, int],
        first: int,
        early: EarlyWeights | None,
    ) -> None:
        self.batch, self.steps, self.ahead, self.first = batch, steps, ahead, first
        self.early = early
        self._begin = progress.begin
        self._several = len(steps) > 1

    # -- the carrier seam (pipepar.core.executor.Carrier) ---------------------------------------
    def begin(self, k: int, action: Action) -> None:
        """Let a forward run on ahead at ``k`` (unless action ``k`` already ran early)."""
        if k in self.ahead and not (self.early is not None and self.early.ran(k)):
            self._prepare(k)

    def take_forward(self, k: int, action: Action) -> tuple[()]:
        self._begin(describe(action, several=self._several))
        return ()

    def give_forward(self, k: int, action: Action, y: Any) -> None:
        pass

    def take_backward(self, k: int, action: Action) -> tuple[()]:
        """Run the next W while this backward's gradients are still on their way."""
        step, i = self.steps[action.stage], action.microbatch
        if self.early is not None and step.defers_weights(i):
            arrived = functools.partial(step.gradients_arrived, i)
            for w, early in self.early.while_waiting(k, arrived):
                if w in self.ahead:
                    self._prepare(w)
                self._begin(describe(early, several=self._several))
                self.steps[early.stage].weight(early.microbatch)
        self._begin(describe(action, several=self._several))
        return ()

    def give_backward(self, k: int, action: Action, grads: Any) -> None:
        pass

    def claim_weight(self, k: int, action: Action) -> bool:
        """False for a W that ran early."""
        if self.early is not None and self.early.ran(k):
            return False
        self._begin(describe(action, several=self._several))
        return True

    def release_weight(self, k: int, action: Action) -> None:
        pass

    def failed(self, action: Action, error: BaseException) -> None:
        """Stop the mini-batch's drivers (they wait on this rank's turns)."""
        self.batch.abort()

    def _prepare(self, k: int) -> None:
        self.batch.drivers[self.ahead[k]].prepare(self.first)
