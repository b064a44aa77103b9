"""Each stage's measured time per action kind, as the costs that place its recomputes.

:func:`pipepar.core.recompute_placement.place_recomputes` moves an ``R`` into a worker's idle
time on a simulated clock, and idle time exists where stages differ in speed: on unit costs a
pipe whose stages all cost the same has none to offer. :class:`ActionTimes` is told about every
computation of one training mini-batch (a :data:`~pipepar.core.step.Recorder`) and, once every
stage has run a forward and a backward, settles on each stage's mean seconds per kind; the
pipe places the recomputes of later mini-batches on those costs. It settles once: a placement
that changed with every step's noise would cost its search on every step.

Across ranks a rank times only its own stages (``stages=``); the ranks share their
:meth:`ActionTimes.means` and each places on :func:`cost_of` the whole pipeline's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from pipepar.core.schedule import Action

__all__ = ["KINDS", "ActionTimes", "Cost", "cost_of"]

_KINDS = {"forward": "F", "recompute": "R", "backward": "B", "weight": "W"}
"""The kinds a step reports (:meth:`pipepar.core.step.StageStep._tell`), as action kinds."""

KINDS = tuple(_KINDS.values())
"""The action kinds timed, in a fixed order (a table of times shared across ranks)."""

Cost = Callable[[Action, bool], float]
"""``cost(action, split)``: an action's seconds (``split``: a B whose W is listed apart)."""


class ActionTimes:
    """Seconds per (stage, action kind), measured over one training mini-batch.

    Args:
        n_stages: the stages of the pipe.
        stages: the stages timed here (None: all), each settled once it ran a forward and a
            backward.

    Example:
        >>> times = ActionTimes(1)
        >>> times.record(0, 0, "forward", 0.0, 1.0)
        >>> times.record(0, 0, "backward", 1.0, 3.0)
        >>> cost = times.cost()
        >>> cost(Action(0, "R", 0), False), cost(Action(0, "B", 0), False)
        (1.0, 2.0)
    """

    def __init__(self, n_stages: int, stages: Collection[int] | None = None) -> None:
        self.n_stages = n_stages
        self.stages = tuple(range(n_stages) if stages is None else sorted(stages))
        self._total: dict[tuple[int, str], float] = {}
        self._count: dict[tuple[int, str], int] = {}
        self._settled: dict[tuple[int, str], float] | None = None

    def record(self, stage: int, microbatch: int, kind: str, start: float, end: float) -> None:
        """A computation of ``stage`` ran from ``start`` to ``end`` (ignored once settled)."""
        letter = _KINDS.get(kind)
        if letter is None or self._settled is not None:
            return
        key = (stage, letter)
        self._total[key] = self._total.get(key, 0.0) + (end - start)
        self._count[key] = self._count.get(key, 0) + 1

    @property
    def settled(self) -> bool:
        """Whether the costs are fixed (every stage timed here ran a forward and a backward)."""
        if self._settled is None and all(
            (s, k) in self._count for s in self.stages for k in ("F", "B")
        ):
            self._settled = self._current()
        return self._settled is not None

    def means(self) -> dict[tuple[int, str], float]:
        """Mean seconds per (stage, action kind) timed so far (the settled ones once settled)."""
        return dict(self._settled or {}) if self.settled else self._current()

    def _current(self) -> dict[tuple[int, str], float]:
        return {key: self._total[key] / n for key, n in self._count.items()}

    def cost(self) -> Cost:
        """``cost(action, split)``: the stage's mean seconds for the action's kind (a
        recompute or a W never seen: the forward's); the settled means once settled.

        Raises:
            ValueError: if a stage has not run a forward and a backward yet.
        """
        if not self.settled:
            raise ValueError(
                "no stage times yet: run a training step (forward and backward) first"
            )
        return cost_of(self.means())


def cost_of(means: Mapping[tuple[int, str], float]) -> Cost:
    """``cost(action, split)`` from mean seconds per (stage, action kind), which hold every
    stage's ``F``: the kind's mean (a recompute or a W never seen: the forward's).

    Example:
        >>> cost = cost_of({(0, "F"): 1.0, (0, "B"): 2.0})
        >>> cost(Action(0, "W", 0), True)
        1.0
    """
    known = dict(means)

    def cost(action: Action, split: bool) -> float:
        return known.get((action.stage, action.kind), known[action.stage, "F"])

    return cost
