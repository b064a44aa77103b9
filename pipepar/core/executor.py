"""The one walk of a worker's schedule actions, for every runtime and every compute.

A schedule (:mod:`pipepar.core.schedule`) gives each worker a list of actions: ``F``,
``R``, ``B`` and ``W`` of a stage on a micro-batch. Whoever runs them (a thread of one
process, a rank of a process group) and whatever a stage computes (a chain of layers, or a
model's own forward cut while it runs) walks that list the same way; :func:`walk` is that
walk, and what differs is behind two seams:

* the **compute** (:class:`Step`): a stage's ``forward(i, x)``, ``rebuild(i)``,
  ``backward(i, g)`` and ``weight(i)`` (:class:`~pipepar.core.step.StageStep` for a chain,
  and the cut's steps, whose inputs and outputs are empty order tokens because the cut
  carries the values);
* the **carrier** (:class:`Carrier`): where an action's input comes from, where its output
  goes, and how a worker waits meanwhile (threads hand values on through slots; ranks hand
  them to their own next stage or send them to another rank). A carrier may fill a wait with
  a deferred weight gradient whose backward already ran (an idle worker's ``W``), and then
  tells the walk, when the walk reaches that ``W`` in the list, that it already ran
  (:meth:`Carrier.claim_weight` is False).

This module knows nothing of threads or process groups: it only calls the two seams in the
list's order. The carrier's methods are bound once per walk, so an action costs the walk a
branch on its kind and two or three calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pipepar.core.errors import add_note
from pipepar.core.schedule import Action

__all__ = ["PHASES", "Carrier", "Step", "note_action", "walk"]

PHASES = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradients"}
"""What each action kind is called in messages."""


class Step(Protocol):
    """One stage's compute of a micro-batch (the compute seam)."""

    def forward(self, i: int, x: Any) -> Any:
        """Micro-batch ``i``'s forward from its input ``x``: the output."""
        ...

    def rebuild(self, i: int) -> None:
        """Micro-batch ``i``'s forward run again from its kept input, for its backward."""
        ...

    def backward(self, i: int, grads: Any) -> Any:
        """Micro-batch ``i``'s backward from its output's gradients: the input's."""
        ...

    def weight(self, i: int) -> None:
        """Micro-batch ``i``'s deferred parameter gradients."""
        ...


class Carrier(Protocol):
    """How values reach the actions of one worker's list and leave them (the carrier seam).

    Every method gets the action's position ``k`` in the walked list and the action.
    """

    def begin(self, k: int, action: Action) -> None:
        """Before the action: stop if the run was aborted, report progress, prepare ahead."""
        ...

    def take_forward(self, k: int, action: Action) -> Any:
        """The forward's input (waiting for it if need be)."""
        ...

    def give_forward(self, k: int, action: Action, y: Any) -> None:
        """Hand the forward's output on (to the next stage, or keep it as an output)."""
        ...

    def take_backward(self, k: int, action: Action) -> Any:
        """The gradients of the backward's output (waiting for them if need be)."""
        ...

    def give_backward(self, k: int, action: Action, grads: Any) -> None:
        """Hand the backward's input gradients on (to the previous stage, or keep them)."""
        ...

    def claim_weight(self, k: int, action: Action) -> bool:
        """Whether the listed ``W`` is to run now (False: the carrier ran it earlier)."""
        ...

    def release_weight(self, k: int, action: Action) -> None:
        """The claimed ``W`` has run or failed."""
        ...

    def failed(self, action: Action, error: BaseException) -> None:
        """The action raised ``error`` (which the walk raises on): annotate it, abort."""
        ...


Steps = Sequence[Step] | Mapping[int, Step]
"""The steps by stage index: every stage's (one process) or this rank's own (ranks)."""


def walk(actions: Sequence[Action], steps: Steps, carrier: Carrier) -> None:
    """Run ``actions`` in order: each stage's step computes, ``carrier`` moves the values.

    Args:
        actions: one worker's list (or the part of it a phase selects).
        steps: the compute of each stage the list names.
        carrier: where inputs come from and outputs go.

    Example:
        >>> from pipepar.core.schedule import make
        >>> class Count:
        ...     def forward(self, i, x): return x + 1
        ...     def rebuild(self, i): pass
        ...     def backward(self, i, g): return g
        ...     def weight(self, i): pass
        >>> class Keep:
        ...     def __init__(self): self.out = {}
        ...     def begin(self, k, a): pass
        ...     def take_forward(self, k, a): return self.out.pop(("F", a.stage, a.microbatch), 0)
        ...     def give_forward(self, k, a, y): self.out[("F", a.stage + 1, a.microbatch)] = y
        ...     def take_backward(self, k, a): return 0
        ...     def give_backward(self, k, a, g): pass
        ...     def claim_weight(self, k, a): return True
        ...     def release_weight(self, k, a): pass
        ...     def failed(self, a, e): pass
        >>> keep = Keep()
        >>> walk(make("gpipe", 1, 2, n_workers=1).worker(0), [Count()], keep)
        >>> keep.out
        {('F', 1, 0): 1, ('F', 1, 1): 1}
    """
    # Bound once: the loop below runs once per action, on tiny stages its cost is the host's.
    begin = carrier.begin
    take_forward, give_forward = carrier.take_forward, carrier.give_forward
    take_backward, give_backward = carrier.take_backward, carrier.give_backward
    claim_weight, release_weight = carrier.claim_weight, carrier.release_weight
    k, action = 0, None
    try:
        for k, action in enumerate(actions):
            # Phase 1: the carrier may stop the walk, report the action, prepare later ones.
            begin(k, action)
            step, i, kind = steps[action.stage], action.microbatch, action.kind
            if kind == "F":
                # Phase 2 (F): input in, compute, output on to the next stage.
                give_forward(k, action, step.forward(i, take_forward(k, action)))
            elif kind == "B":
                # Phase 2 (B): output gradients in, compute, input gradients back.
                give_backward(k, action, step.backward(i, take_backward(k, action)))
            elif kind == "R":
                # Phase 2 (R): the forward again from the kept input; nothing moves.
                step.rebuild(i)
            elif claim_weight(k, action):
                # Phase 2 (W): unless the carrier ran it while waiting; nothing moves.
                try:
                    step.weight(i)
                finally:
                    release_weight(k, action)
    except BaseException as error:
        if action is not None:
            carrier.failed(action, error)
        raise


def note_action(error: BaseException, where: str, action: Action) -> None:
    """Add to ``error`` (once) where it was raised: ``where`` (the stage), the micro-batch and
    the phase of ``action``."""
    if getattr(error, "_pipepar_noted", False):
        return
    phase = PHASES[action.kind]
    add_note(error, f"pipepar: raised in {where}, micro-batch {action.microbatch}, {phase}")
    error._pipepar_noted = True  # type: ignore[attr-defined]
