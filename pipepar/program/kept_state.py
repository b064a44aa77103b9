"""A state a model keeps on itself between micro-batches: found, named and refused.

A recurrent model may keep its last state on itself (``self.state = out``, a Transformer-XL
memory) and add it in its next call. Through a pipe, the next call on that model is the next
*micro-batch*: micro-batch 1 would read micro-batch 0's rows (or a call's first micro-batch the
previous call's last), which the plain model on the whole batch never does. The cut
(:mod:`pipepar.program.cut`) marks every tensor computed from a micro-batch's rows; what this
module gives it:

* which operations use no value of a tensor in what they compute (:func:`use_of`): its shape
  (a recurrent cache's batch size decides whether to start afresh), a tensor of zeros shaped
  like it, an overwrite (``state.copy_(new)``), an update in place (a running statistic's
  ``mul_``: the state stays the other micro-batch's, and reading it later is refused);
* whether the model holds such a tensor on itself at a micro-batch's end (:func:`holds`): then
  no route is learned from that call, so the next call, which may read it, runs under the cut's
  mode and is seen doing it (a learned route runs without the mode);
* where the model holds it (:func:`where_held`), for the refusal's message (:func:`kept_state`).

What a model keeps that no micro-batch's rows made (a rotary table, a mask built from shapes,
an ``inv_freq`` buffer) and what it stores but never reads back (attention maps kept for
inspection) are not refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipepar.core.forms import writes_in_place

__all__ = [
    "KEPT",
    "METADATA",
    "REPLACED",
    "SHAPE_ONLY",
    "holds",
    "kept_state",
    "saved_with_weights",
    "use_of",
    "where_held",
]

METADATA = frozenset(
    {"shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "len", "dtype",
     "device", "layout", "requires_grad", "is_floating_point", "is_complex", "stride",
     "is_contiguous", "element_size", "is_cuda", "is_meta"}
)  # fmt: skip
"""Reads of a tensor's metadata (as :func:`~pipepar.core.forms.op_name` spells them): they use
no value, so no gradient flows through them. A model may read the shape of a state it keeps on
itself (a recurrent cache) to decide whether to start afresh."""

SHAPE_ONLY = frozenset(
    {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
     torch.randn_like, torch.randint_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty,
     Tensor.new_full}
)  # fmt: skip
"""Operations making a tensor from only the shape, dtype and device of their tensor argument:
what they make holds no row's values."""

_OVERWRITES = frozenset({"copy_", "fill_", "zero_"})
"""In-place operations replacing every value of the tensor they write into (their first
argument) without reading it."""

KEPT = "kept"
"""How an operation uses a kept state: none of its values flow anywhere but into itself (its
metadata is read, or it is updated in place): it stays the other micro-batch's."""
REPLACED = "replaced"
"""None of its values are read: it is overwritten, or a new tensor is shaped like it."""


def use_of(name: str, func: Any, t: Tensor, args: Sequence[Any]) -> str | None:
    """How operation ``func`` (named ``name`` as :func:`~pipepar.core.forms.op_name` spells
    it, given ``args``) uses ``t``, a state another micro-batch made, when no value of ``t``
    reaches what it computes: :data:`KEPT` or :data:`REPLACED`; None when it reads them.

    Args:
        name: the operation's name.
        func: the operation.
        t: one of its tensor arguments.
        args: its positional arguments.
    """
    if name in METADATA:
        return KEPT
    if func in SHAPE_ONLY:
        return REPLACED
    if not args or args[0] is not t:
        return None
    spelled = getattr(func, "__name__", "")
    if spelled in _OVERWRITES:
        return REPLACED
    return KEPT if writes_in_place(func) else None


def holds(model: nn.Module, kept: Callable[[Tensor], bool]) -> bool:
    """Whether ``model`` holds a tensor for which ``kept`` is true, as an attribute or buffer
    of any of its modules (one level into a list, tuple or dict). Run at the end of each
    micro-batch under the cut's mode, so written for speed (:func:`_held` says where)."""
    for module in model.modules():
        found = module.__dict__
        if any(kept(b) for b in found["_buffers"].values() if b is not None):
            return True
        for name in found.keys() - _MODULE_INTERNALS:
            value = found[name]
            if isinstance(value, Tensor):
                if kept(value):
                    return True
            elif isinstance(value, (list, tuple)):
                if any(isinstance(item, Tensor) and kept(item) for item in value):
                    return True
            elif isinstance(value, dict) and any(
                isinstance(item, Tensor) and kept(item) for item in value.values()
            ):
                return True
    return False


def where_held(model: nn.Module | None, t: Tensor) -> str | None:
    """Where ``model`` holds ``t`` (``"layers.0.mixer.state"``), or None if it does not."""
    if model is None:
        return None
    for where, held in _held(model):
        if held is t:
            return where
    return None


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""What ``nn.Module`` itself keeps in a module's ``__dict__`` (its parameters, buffers,
submodules, hooks, flags): no state of the model's but its buffers, looked at by name."""


def _held(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Each tensor the modules of ``model`` hold (parameters left out), with where."""
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        found = vars(module)
        for key, buffer in found["_buffers"].items():
            if isinstance(buffer, Tensor):
                yield prefix + key, buffer
        for name in found.keys() - _MODULE_INTERNALS:
            for suffix, t in _tensors(found[name]):
                yield prefix + name + suffix, t


def _tensors(value: Any) -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        if not isinstance(value, nn.Parameter):
            yield "", value
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            if isinstance(item, Tensor):
                yield f"[{k}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, Tensor):
                yield f"[{key!r}]", item


def saved_with_weights(model: nn.Module | None, t: Tensor) -> bool:
    """Whether ``t`` is a buffer ``model`` saves with its weights (in its ``state_dict``):
    the model's own state, such as a batch norm's running statistics or an average kept in
    place, which the plain model reads across calls too. A state whose rows are a call's
    (a recurrent cache) is not saved with the weights: its shape is the batch's."""
    if model is None:
        return False
    for module in model.modules():
        skipped = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is t and name not in skipped:
                return True
    return False


def kept_state(t: Tensor, stage: int, where: str | None) -> RuntimeError:
    """The refusal of stage ``stage`` using the values of ``t``, computed from another
    micro-batch's rows or an earlier call's and held by the model at ``where``."""
    what = f"the state {where!r} the model keeps on itself" if where else "a state kept"
    return RuntimeError(
        f"stage {stage} uses the values of {what} (shape {tuple(t.shape)}), computed from "
        "another micro-batch's rows or an earlier call's: through a pipe each micro-batch is a "
        "call of its own, so it would read another micro-batch's state, which the plain model "
        "on the whole batch never does. Turn the state off (e.g. use_cache=False), or keep it "
        "outside the model: pass it in and take it from the outputs (pipepar splits and joins "
        "it with the batch)"
    )
