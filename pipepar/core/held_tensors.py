"""The tensors a loss function holds: the same for every micro-batch, so constants of its loss.

A ``loss_fn`` is called once per micro-batch with that micro-batch's output and target. Any
other tensor it computes with was there before the call and is the same object for every
micro-batch: a count of the whole batch bound with ``functools.partial`` (torchtitan divides a
summed cross-entropy by ``global_valid_tokens``, the real targets of every micro-batch of every
accumulation step), a closure's or a script's variable, a default argument, a class weight kept
on a loss module. Such a tensor is none of the micro-batch's rows. The loss probe
(:class:`~pipepar.core.reductions.Probe`) takes these as constants; a tensor it cannot trace
to an operation of the call is otherwise taken for a value of the batch (it might be one made
from the target outside torch), and a sum divided by it could not be joined.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

__all__ = ["held_tensors"]

_SMALL = 64


def held_tensors(fn: Any) -> list[Tensor]:
    """The tensors ``fn`` holds: bound by ``functools.partial`` (through nested partials), in
    its closure, its default arguments or the module variables its code names, on the object
    of a bound method or a callable object (its attributes; a module's parameters and buffers
    too), each small container one level deep.

    Example:
        >>> n = torch.tensor(12)
        >>> loss_fn = functools.partial(summed_loss, global_valid_tokens=n)
        >>> [t is n for t in held_tensors(loss_fn)]
        [True]
    """
    found: dict[int, Tensor] = {}
    for value in _held(fn, depth=3):
        for t in _tensors(value):
            found.setdefault(id(t), t)
    return list(found.values())


def _held(fn: Any, depth: int) -> Iterator[Any]:
    """The values ``fn`` holds (``depth`` bounds nested partials and wrapped functions)."""
    if depth == 0 or fn is None:
        return
    if isinstance(fn, functools.partial):
        yield from fn.args
        yield from fn.keywords.values()
        yield from _held(fn.func, depth - 1)
        return
    if isinstance(fn, nn.Module):
        yield from fn.parameters()
        yield from fn.buffers()
    owner = getattr(fn, "__self__", None)  # a bound method's object
    if owner is not None and not isinstance(owner, type):
        yield from _held(owner, depth - 1)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and isinstance(names, dict):  # the module's variables it reads
        yield from (names[n] for n in code.co_names if n in names)
    yield from getattr(fn, "__defaults__", None) or ()
    yield from (getattr(fn, "__kwdefaults__", None) or {}).values()
    attributes = getattr(fn, "__dict__", None)
    if isinstance(attributes, dict):
        yield from attributes.values()
    wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps
    if wrapped is not None:
        yield from _held(wrapped, depth - 1)


def _tensors(value: Any) -> Iterator[Tensor]:
    """``value`` if a tensor, else the tensors directly in it (a list, tuple or dict of at
    most :data:`_SMALL` entries: what a loss function keeps, not a data set it refers to)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple, dict)) and len(value) <= _SMALL:
        items = value.values() if isinstance(value, dict) else value
        yield from (v for v in items if isinstance(v, Tensor))
