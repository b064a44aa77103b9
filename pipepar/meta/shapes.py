"""Operations on ``meta`` answered from memory: what an operation made from inputs of those shapes.

An operation on ``meta`` computes nothing but its outputs' shapes, dtypes and strides, yet torch
works many of those out in Python (the reference implementations behind the meta kernels of
elementwise operations, reductions, scans), a tenth of a millisecond or more each. A rank that
follows other ranks' stages on ``meta`` (:mod:`pipepar.program.ranks`) runs the same operations
on the same shapes micro-batch after micro-batch, so :class:`MetaShapes` remembers what each
*functional* operation (no input written, no output aliasing an input) made from inputs of given
shapes, dtypes and strides and given other arguments, and makes fresh outputs of that shape
directly the next time. Views and in-place operations always run (their outputs share an
input's storage and version); so does any call with an argument it cannot describe exactly.

It works below autograd (in :class:`~pipepar.meta.values.MetaScalars`' dispatch), so
whether an output requires a gradient is still autograd's answer.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MetaShapes"]

_PLAIN = (
    int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format
)  # fmt: skip


class _Opaque(Exception):
    """An argument whose value cannot be part of a key."""


class MetaShapes:
    """Output shapes of functional operations on ``meta``, by operation and inputs.

    Args:
        limit: entries kept; past it the memory starts again (a model whose shapes change every
            call does not grow it without bound).

    Example:
        >>> shapes = MetaShapes()
        >>> a = torch.empty(2, 3, device="meta")
        >>> key = shapes.key(torch.ops.aten.add.Tensor, (a, a), {})
        >>> shapes.remember(key, torch.ops.aten.add.Tensor(a, a))
        >>> shapes.made(key).shape
        torch.Size([2, 3])
    """

    def __init__(self, limit: int = 4096) -> None:
        self._known: dict[Hashable, Any] = {}
        self._functional: dict[Any, bool] = {}
        self._limit = limit

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
        """What decides the outputs of ``func(*args, **kwargs)``, or None if it is not a
        functional operation on ``meta`` tensors that can be described exactly."""
        if not self._is_functional(func):
            return None
        try:
            return (func, _describe(args), _describe(kwargs))
        except _Opaque:
            return None

    def made(self, key: Hashable) -> Any:
        """Fresh outputs for a call of ``key`` seen before, or None."""
        template = self._known.get(key)
        return None if template is None else _build(template)

    def remember(self, key: Hashable, out: Any) -> None:
        """Keep the shapes of ``out``, what a call of ``key`` returned (if only meta tensors)."""
        template = _template(out)
        if template is None:
            return
        if len(self._known) >= self._limit:
            self._known.clear()
        self._known[key] = template

    def __len__(self) -> int:
        return len(self._known)

    def _is_functional(self, func: Any) -> bool:
        found = self._functional.get(func)
        if found is None:
            found = self._functional[func] = _functional(func)
        return found


def _functional(func: Any) -> bool:
    """An operator that writes no input and returns only new tensors."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return False
    for ret in schema.returns:
        if ret.alias_info is not None or str(ret.type) not in ("Tensor", "Tensor[]"):
            return False
    return True


def _describe(value: Any) -> Hashable:
    if isinstance(value, Tensor):
        if not value.is_meta or value.layout != torch.strided or value.is_conj() or value.is_neg():
            raise _Opaque
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_describe(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _describe(v)) for k, v in value.items()))
    if isinstance(value, _PLAIN):
        return (type(value), value)  # 1, 1.0 and True are equal keys otherwise
    raise _Opaque


def _template(out: Any) -> Any:
    if isinstance(out, Tensor):
        if not out.is_meta or out.layout != torch.strided:
            return None
        return (tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)):
        parts = [_template(t) if isinstance(t, Tensor) else None for t in out]
        if any(p is None for p in parts):
            return None
        return (type(out), parts)
    return None


def _build(template: Any) -> Any:
    first, second, *_ = template
    if isinstance(first, type):  # a tuple or list of outputs
        return first(_build(part) for part in second)
    shape, stride, dtype = template
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
