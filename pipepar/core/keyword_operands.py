"""Operands passed by keyword, moved to the positions torch's own signature gives them.

The probe (:mod:`pipepar.core.reductions`) reads each operation's operands by position:
``addmm``'s bias, then its two matrices. Code outside the project also names them: BLOOM's
attention calls ``alibi.baddbmm(batch1=query, batch2=key, beta=..., alpha=...)``, and
``torch.matmul(a, other=b)`` is valid torch. Read by position, such a call has no matrices, and
the probe failed on it (``IndexError``) before the model ran a step.

:func:`positional` moves every keyword argument that fills the next positional slot of the
callable's signature into ``args``, in order, so that the call reads the same however it was
spelled. The signature is the function's own where Python can read it
(``torch.nn.functional``'s), otherwise the schema of the ATen operator of the same name (the
bindings of ``torch.*`` and ``Tensor`` methods are generated from it; its ``self`` is a
function's ``input``). A name no schema knows, or a keyword that is not the next position,
stays where it was.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["positional"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def positional(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` of a call of ``func``, the keyword arguments that fill its next
    positional parameters moved into ``args``: the same call, spelled by position.

    Example:
        >>> a, b = torch.ones(2, 3), torch.ones(3, 4)
        >>> args, kwargs = positional(torch.matmul, (a,), {"other": b})
        >>> len(args), kwargs
        (2, {})
    """
    if not kwargs:
        return args, kwargs
    try:
        names = _positional_names(func)
    except TypeError:  # a callable that cannot be hashed, so not cached: read as spelled
        return args, kwargs
    if not names or len(args) >= len(names):
        return args, kwargs
    moved, rest = list(args), dict(kwargs)
    for name in names[len(args) :]:
        if name not in rest:
            break
        moved.append(rest.pop(name))
    return tuple(moved), rest


@functools.lru_cache(maxsize=1024)
def _positional_names(func: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``func``'s positional parameters, in order; empty where unknown."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin: its ATen schema
        return _schema_names(getattr(func, "__name__", ""))
    return tuple(p.name for p in params if p.kind in _POSITIONAL)


def _schema_names(name: str) -> tuple[str, ...]:
    """The positional argument names of ATen's operator ``name`` (its default overload, else
    its first), ``self`` read as ``input``; empty where ATen has no such operator."""
    if not name or name.startswith("_"):
        return ()
    try:
        packet = getattr(torch.ops.aten, name)
        overloads = packet.overloads()
    except (AttributeError, RuntimeError):
        return ()
    if not overloads:
        return ()
    overload = "default" if "default" in overloads else overloads[0]
    schema = getattr(packet, overload)._schema
    names = (a.name for a in schema.arguments if not a.kwarg_only)
    return tuple("input" if n == "self" else n for n in names)
