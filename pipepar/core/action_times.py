"""Each stage's measured time per action kind, as the costs that place its recomputes.

:func:`pipepar.core.recompute_placement.place_recomputes` moves an ``R`` into a worker's idle
time on a simulated clock, and idle time exists where stages differ in speed: on unit costs a
pipe whose stages all cost the same has none to offer. :class:`ActionTimes` is told about every
computation of one training mini-batch (a :data:`~pipepar.core.step.Recorder`) and, once every
stage has run a forward and a backward, settles on each stage's mean seconds per kind; the
pipe places the recomputes of later mini-batches on those costs. It settles once: a placement
that changed with every step's noise would cost its search on every step.
"""

from __future__ import annotations

from collections.abc import Callable

from pipepar.core.schedule import Action

__all__ = ["ActionTimes"]

_KINDS = {"forward": "F", "recompute": "R", "backward": "B", "weight": "W"}
"""The kinds a step reports (:meth:`pipepar.core.step.StageStep._tell`), as action kinds."""


class ActionTimes:
    """Seconds per (stage, action kind), measured over one training mini-batch.

    Args:
        n_stages: the stages of the pipe.

    Example:
        >>> times = ActionTimes(1)
        >>> times.record(0, 0, "forward", 0.0, 1.0)
        >>> times.record(0, 0, "backward", 1.0, 3.0)
        >>> cost = times.cost()
        >>> cost(Action(0, "R", 0), False), cost(Action(0, "B", 0), False)
        (1.0, 2.0)
    """

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
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
        """Whether the costs are fixed (every stage ran a forward and a backward)."""
        if self._settled is None and all(
            (s, k) in self._count for s in range(self.n_stages) for k in ("F", "B")
        ):
            self._settled = {key: self._total[key] / n for key, n in self._count.items()}
        return self._settled is not None

    def cost(self) -> Callable[[Action, bool], float]:
        """``cost(action, split)``: the stage's mean seconds for the action's kind (a
        recompute or a W never seen: the forward's); the settled means once settled.

        Raises:
            ValueError: if a stage has not run a forward and a backward yet.
        """
        if not self.settled:
            raise ValueError(
                "no stage times yet: run a training step (forward and backward) first"
            )
        means = dict(self._settled or {})

        def cost(action: Action, split: bool) -> float:
            forward = means[action.stage, "F"]
            return means.get((action.stage, action.kind), forward)

        return cost
