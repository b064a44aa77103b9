"""Checkpointed unit calls recomputed when told: what an ``R`` action of a model cut while it
runs rebuilds.

torch's checkpoint recomputes a unit on the first unpack of what it saved, inside the backward,
and has no trigger of its own. A micro-batch whose recompute the schedule lists as an ``R``
(:mod:`pipepar.core.recompute_placement`) needs one: its units' recompute runs in a worker's
idle time, ahead of the backward. So each of its checkpointed unit calls keeps, as torch's
checkpoint does, the unit's arguments, and in place of each tensor its operations save for
backward a :class:`_Slot` (the tensor itself dropped), in the order they were saved.
:meth:`UnitCalls.recompute` (the ``R``) runs every unit call of the micro-batch again, in
order, with the first run's contexts (the same random draws, tied-weight stand-ins, batch-norm
statistics left alone: :mod:`pipepar.program.recompute`), and fills the slots in the order
the recompute saves; the backward then reads the filled tensors, as often as it reads them (B,
then W of a split backward). A slot unread when nothing ran the ``R`` recomputes its call then,
as torch's checkpoint would. A filled tensor lives as long as its slot: until the backward pass
that reads it last lets go of the graph, as the rebuilt graph of a chain's ``R`` does.

Nothing here knows about stages or schedules: the stage's step decides which micro-batches
record their calls (:mod:`pipepar.program.step`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pipepar.core.step import Autocast

__all__ = ["UnitCall", "UnitCalls"]

Context = contextlib.AbstractContextManager[Any]


class _Slot:
    """What the graph holds for one tensor a unit call saved: its shape, dtype and device
    (the recompute must save the same), and the tensor once recomputed."""

    __slots__ = ("__weakref__", "call", "device", "dtype", "shape", "tensor")

    def __init__(self, t: Tensor, call: UnitCall) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.tensor: Tensor | None = None
        self.call = call  # the graph holds the call (its arguments) through its slots


class UnitCall:
    """One checkpointed call of a unit: its forward and arguments, and a slot per tensor it
    saved for backward.

    Args:
        forward: the unit's forward.
        args: its positional arguments.
        kwargs: its keyword arguments.
        name: the unit, for errors (its class name).
        first: entered around the first run (notes what a recompute needs again).
        again: entered around each recompute (the first run's random draws, stand-ins, ...).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        name: str,
        first: Callable[[], Context],
        again: Context,
    ) -> None:
        self.forward, self.args, self.kwargs = forward, args, kwargs
        self.name, self._first, self._again = name, first, again
        self.autocast = Autocast.capture()
        self.slots: list[weakref.ref[_Slot]] = []
        self.done = False

    def run(self) -> Any:
        """The first run: what the unit saves is dropped, a slot kept in its place."""
        with self._first(), torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            return self.forward(*self.args, **self.kwargs)

    def _pack(self, t: Tensor) -> _Slot:
        slot = _Slot(t, self)
        self.slots.append(weakref.ref(slot))
        return slot

    def recompute(self) -> None:
        """Run the unit again, filling its slots in the order it saves (once: a call filled
        already is left as it is)."""
        if self.done:
            return
        filling = _Filling(self)
        hooks = torch.autograd.graph.saved_tensors_hooks(filling.pack, _unused)
        with self._again, self.autocast(), torch.enable_grad(), hooks:
            self.forward(*self.args, **self.kwargs)
        filling.check()
        self.done = True


class _Filling:
    """The pack hook of a recompute: each saved tensor into the slot of the same position."""

    def __init__(self, call: UnitCall) -> None:
        self.call, self.k = call, 0

    def pack(self, t: Tensor) -> None:
        slots, k = self.call.slots, self.k
        self.k += 1
        if k >= len(slots):
            raise self._mismatch(f"more than the {len(slots)} tensors")
        slot = slots[k]()
        if slot is None:  # the backward read it and let it go already
            return
        if (t.shape, t.dtype, t.device) != (slot.shape, slot.dtype, slot.device):
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}"
            raise self._mismatch(
                f"tensor {k} as {got}, not as {tuple(slot.shape)} {slot.dtype} on {slot.device}"
            )
        slot.tensor = t.detach() if t.requires_grad else t

    def check(self) -> None:
        if self.k != len(self.call.slots):
            raise self._mismatch(f"{self.k} tensors, not the {len(self.call.slots)}")

    def _mismatch(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"pipepar: recomputing {self.call.name} saved {what} its first run saved for "
            "backward; a recomputed unit must do on the same input what it did the first time "
            "(no branch on state its first run changed); pass checkpoint='never' for this model"
        )


def _unpack(slot: _Slot) -> Tensor:
    """The recomputed tensor; recomputed now if nothing ran the call's recompute yet."""
    if slot.tensor is None:
        slot.call.recompute()
    assert slot.tensor is not None  # filled by the recompute, or it raised
    return slot.tensor


def _unused(packed: None) -> Tensor:
    raise RuntimeError("pipepar: a unit's recompute keeps no graph to run backward through")


class UnitCalls:
    """The checkpointed unit calls of one micro-batch on one stage, in the order they ran.

    Holds each call weakly: the graph holds a call through its slots, and a call whose
    slots are gone (read and freed, or none saved) has nothing left to recompute."""

    def __init__(self) -> None:
        self._calls: list[weakref.ref[UnitCall]] = []
        self.rebuilt = False

    def run(self, call: UnitCall) -> Any:
        """Run ``call`` for the first time, noted for :meth:`recompute`."""
        self._calls.append(weakref.ref(call))
        return call.run()

    def recompute(self) -> None:
        """Recompute every call still held, in the order they first ran."""
        for ref in self._calls:
            call = ref()
            if call is not None:
                call.recompute()
        self.rebuilt = True
