"""One low-precision copy of each weight per mini-batch, saved by every micro-batch's graph.

Under ``torch.autocast`` a matrix product computes with a bfloat16 (or float16) copy of its
float32 weight, and its graph saves that copy for the input's gradient. Autocast keeps such
copies in a cache of the thread, cleared when the autocast context is left. A plain loop under
one autocast therefore casts each weight once, and every micro-batch's graph saves the same
copy. A model pipe runs each micro-batch's forward on a thread of its own (its driver), so each
micro-batch would cast, and keep until its backward, a copy of its own: with GPipe, M copies of
every weight.

:class:`SharedCopies` is a pair of saved-tensor hooks for a stage's forwards: a tensor about to
be saved that is a cast copy of one of the stage's weights (``weight.to(dtype)``, or its
transpose, as ``nn.Linear`` saves it) is saved as the stage's one copy of that weight in that
dtype instead, made the first time (the same cast, so the same values). Each micro-batch's own
copy is then freed when its forward leaves the autocast. Any other tensor is saved as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pipepar.core.split_backward import CAST, TRANSPOSE

__all__ = ["SharedCopies"]

_LOW = frozenset((torch.bfloat16, torch.float16))


class SharedCopies:
    """The saved-tensor hooks (:meth:`saving`) that save one copy per weight and dtype.

    Args:
        params: the stage's weights (and the leaves standing for weights other stages hold).
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = {id(p): p for p in params}
        self._copies: dict[tuple[int, torch.dtype, bool], Tensor] = {}

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks, to be entered around a forward under autocast."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def clear(self) -> None:
        """Forget the copies (the mini-batch's graphs that saved them are gone)."""
        self._copies = {}

    def pack(self, t: Tensor) -> Tensor:
        """The tensor to save in place of ``t``: the stage's copy of a weight if ``t`` is a
        cast copy of one, else ``t`` itself."""
        if t.dtype not in _LOW or t.grad_fn is None:
            return t
        found = self._weight_of(t.grad_fn)
        if found is None:
            return t
        param, transposed = found
        key = (id(param), t.dtype, transposed)
        copy = self._copies.get(key)
        if copy is None:
            with torch.no_grad():
                base = param.detach().to(t.dtype)
            copy = base.t() if transposed else base
            if _laid_out_as(copy, t):  # kept only where it stands in for a saved copy
                self._copies[key] = copy
        return copy if _laid_out_as(copy, t) else t

    def _weight_of(self, node: Any) -> tuple[Tensor, bool] | None:
        """The weight whose cast (or the cast's transpose) ``node`` made, if it is one of the
        stage's, and whether transposed."""
        transposed = type(node).__name__ == TRANSPOSE
        if transposed:
            node = node.next_functions[0][0]
            if node is None:
                return None
        if type(node).__name__ != CAST:
            return None
        accumulator = node.next_functions[0][0]
        param = self._params.get(id(getattr(accumulator, "variable", None)))
        return (param, transposed) if param is not None else None


def _laid_out_as(copy: Tensor, t: Tensor) -> bool:
    return copy.shape == t.shape and copy.stride() == t.stride() and copy.device == t.device


def _unpack(saved: Tensor) -> Tensor:
    return saved
