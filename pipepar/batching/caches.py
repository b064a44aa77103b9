"""Key-value caches (transformers' ``Cache`` objects) split over micro-batches and joined again.

A language model called with ``use_cache=True`` (the default of GPT-2 and Llama) returns a cache
object holding every layer's keys and values, ``[batch, heads, seq, dim]``; generation passes it
back in at each decode step, and the model updates it in place. A pipe treats it as a tensor
with the batch on dimension 0:

- splitting (:func:`split`): micro-batch ``i`` gets a copy of the cache whose tensors are its
  rows of the caller's (views), so the model's own code updates a cache of its own rows;
- joining (:func:`join`): the micro-batches' caches become one, each tensor the concatenation of
  their rows. When the call passed a cache in, its contents are written back into that very
  object, which is returned (the plain model updates the caller's cache in place too).

A static cache (``cache_implementation="static"``) is updated in place: its micro-batches write
into their row views of the caller's tensors, which then hold the joined cache already and keep
their addresses; each micro-batch advances a copy of its length counter, and the caller's
counter is set to theirs. A layer's row count (``batch_size``) is split and summed with the rows.

Joined cache tensors are detached: no gradient flows through a returned cache (the logits and
the loss carry the gradients). With one micro-batch the caller's cache goes to the model as it
is; :func:`detach_caches` then cuts its tensors from the graph.

The structure is walked generically: a cache's and its layers' attributes (``layers``,
``keys``, ``values``, an encoder-decoder cache's two caches, flags and counters), through lists,
tuples and dicts. transformers is never imported here: a cache is recognized by the classes of
``transformers.cache_utils`` once the user's code has imported it.
"""

from __future__ import annotations

import copy
import reprlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["detach_caches", "is_cache", "join", "split", "tensors_of"]

_ORIGIN = "_pipepar_origin"
"""The attribute naming, on a micro-batch's copy of a cache, the caller's cache it came from."""

_ROWS = "batch_size"
"""The attribute in which a cache layer may count its rows (split and summed with them)."""

_LAYER_BASES = ("CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer")


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``...).

    Example:
        >>> is_cache(torch.zeros(2))
        False
    """
    types = _types(("Cache",))
    return bool(types) and isinstance(value, types)


def split(cache: Any, n: int, m: int) -> list[Any]:
    """``m`` caches, one per micro-batch of a batch of ``n`` rows: each tensor with ``n`` rows
    is cut into ``m`` row views (as ``tensor_split``), other tensors (counters) are copied, flags
    shared. With one micro-batch the cache itself (the model updates it in place, as without a
    pipe)."""
    if m == 1:
        return [cache]
    return _split_value(cache, n, m)


def join(pieces: Sequence[Any], rows: Sequence[int], where: str = "cache") -> Any:
    """One cache from the micro-batches' caches (``rows[i]`` rows each): every tensor the
    concatenation of their rows, detached. Written into the caller's cache when the pieces were
    split from one (and that object returned), else into a new cache of the same type.

    Raises:
        ValueError: a value differs between micro-batches beyond their rows (a tensor's other
            dimensions, a flag, a counter).
    """
    return _merged(list(pieces), rows, where, None)


def detach_caches(values: Sequence[Any]) -> None:
    """Cut the tensors of every cache among ``values`` (an output's leaves) from the autograd
    graph, in place: no gradient flows through a returned cache."""
    for value in values:
        if is_cache(value):
            _detach(value)


def tensors_of(value: Any) -> list[Tensor]:
    """Every tensor a cache (or a list, tuple or dict of them) holds: its layers' keys and
    values, its counters."""
    if isinstance(value, Tensor):
        return [value]
    if _is_state(value):
        items = [v for name, v in vars(value).items() if name != _ORIGIN]
    elif type(value) in (list, tuple):
        items = list(value)
    elif type(value) is dict:
        items = list(value.values())
    else:
        return []
    return [t for item in items for t in tensors_of(item)]


# -- splitting ----------------------------------------------------------------------------------
def _split_value(value: Any, n: int, m: int) -> list[Any]:
    if isinstance(value, Tensor):
        if value.dim() > 0 and value.shape[0] == n:
            return list(value.tensor_split(m))
        # a counter (a static layer's length) or a constant: a copy each, as the model may
        # advance it in place once per micro-batch
        return [value.clone() for _ in range(m)]
    if _is_state(value):
        return _split_state(value, n, m)
    if type(value) in (list, tuple):
        columns = [_split_value(v, n, m) for v in value]
        return [type(value)(col[i] for col in columns) for i in range(m)]
    if type(value) is dict:
        parts = {k: _split_value(v, n, m) for k, v in value.items()}
        return [{k: col[i] for k, col in parts.items()} for i in range(m)]
    return [value] * m


def _split_state(state: Any, n: int, m: int) -> list[Any]:
    """Copies of a cache (or cache layer) holding each micro-batch's rows."""
    pieces = [copy.copy(state) for _ in range(m)]
    rows = [len(r) for r in torch.arange(n).tensor_split(m)]
    for name, value in vars(state).items():
        if name == _ORIGIN:
            continue
        parts = rows if _counts_rows(name, [value], [n]) else _split_value(value, n, m)
        for piece, part in zip(pieces, parts):
            piece.__dict__[name] = part
    if is_cache(state):
        for piece in pieces:
            piece.__dict__[_ORIGIN] = state
    return pieces


# -- joining ------------------------------------------------------------------------------------
def _merged(column: list[Any], rows: Sequence[int], where: str, into: Any) -> Any:
    """The value of the whole batch from the micro-batches' ``column``; ``into`` is the
    caller's object at this place (updated in place when there is one)."""
    first = column[0]
    if isinstance(first, Tensor):
        return _joined_tensor(column, rows, where, into)
    if _is_state(first):
        return _merged_state(column, rows, where, into)
    if type(first) in (list, tuple):
        return _merged_sequence(column, rows, where, into)
    if type(first) is dict:
        return _merged_dict(column, rows, where, into)
    for value in column[1:]:
        if not _same(value, first):
            raise _differs(where, first, value)
    return first


def _joined_tensor(column: list[Any], rows: Sequence[int], where: str, into: Any) -> Tensor:
    first = column[0]
    if all(isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == r for t, r in zip(column, rows)):
        for t in column[1:]:
            if t.shape[1:] != first.shape[1:]:
                raise _differs(where, first, t)
        if isinstance(into, Tensor) and _views_of(into, column):
            return into  # updated in place (a static cache): joined already
        return torch.cat([t.detach() for t in column])
    for t in column[1:]:
        same = t is first or (
            isinstance(t, Tensor) and t.shape == first.shape and bool(torch.equal(t, first))
        )
        if not same:
            raise _differs(where, first, t)
    if isinstance(into, Tensor) and _alike(into, first):
        if not torch.equal(into, first):  # a counter the micro-batches advanced alike
            with torch.no_grad():
                into.copy_(first)
        return into  # the caller's tensor stays (a static cache keeps its addresses)
    return first.detach()


def _views_of(into: Tensor, column: list[Tensor]) -> bool:
    """Whether the pieces are still the row views of the caller's tensor ``into``."""
    if into.device.type == "meta" or into.dim() == 0:
        return False
    storage = into.untyped_storage().data_ptr()
    return sum(t.shape[0] for t in column) == into.shape[0] and all(
        t.shape[1:] == into.shape[1:] and t.untyped_storage().data_ptr() == storage for t in column
    )


def _alike(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _merged_state(column: list[Any], rows: Sequence[int], where: str, into: Any) -> Any:
    first = column[0]
    origins = {id(piece.__dict__.get(_ORIGIN)) for piece in column}
    origin = first.__dict__.get(_ORIGIN) if len(origins) == 1 else None
    if origin is not None:
        out = origin
    elif into is not None and type(into) is type(first):
        out = into
    else:
        out = copy.copy(first)
        out.__dict__.pop(_ORIGIN, None)
    reuse = out is origin or out is into
    for name in vars(first):
        if name == _ORIGIN:
            continue
        parts = [piece.__dict__.get(name) for piece in column]
        if _counts_rows(name, parts, rows):
            out.__dict__[name] = sum(rows)
            continue
        before = out.__dict__.get(name) if reuse else None
        out.__dict__[name] = _merged(parts, rows, f"{where}.{name}", before)
    return out


def _counts_rows(name: str, values: Sequence[Any], rows: Sequence[int]) -> bool:
    """Whether attribute ``name`` is a layer's count of its rows (static and linear-attention
    layers keep one as ``batch_size``)."""
    return name == _ROWS and all(type(v) is int and v == r for v, r in zip(values, rows))


def _merged_sequence(column: list[Any], rows: Sequence[int], where: str, into: Any) -> Any:
    first = column[0]
    for value in column[1:]:
        if type(value) is not type(first) or len(value) != len(first):
            raise _differs(where, first, value)
    reuse = type(into) is type(first)
    items = [
        _merged(
            [value[k] for value in column],
            rows,
            f"{where}[{k}]",
            into[k] if reuse and k < len(into) else None,
        )
        for k in range(len(first))
    ]
    if isinstance(into, list) and reuse:
        into[:] = items  # the caller's list object stays the one its cache holds
        return into
    return type(first)(items)


def _merged_dict(column: list[Any], rows: Sequence[int], where: str, into: Any) -> Any:
    first = column[0]
    for value in column[1:]:
        if type(value) is not dict or value.keys() != first.keys():
            raise _differs(where, first, value)
    reuse = type(into) is dict
    items = {
        k: _merged(
            [value[k] for value in column], rows, f"{where}[{k!r}]", into.get(k) if reuse else None
        )
        for k in first
    }
    if reuse:
        into.clear()
        into.update(items)
        return into
    return items


def _differs(where: str, a: Any, b: Any) -> ValueError:
    return ValueError(
        f"{where} differs between micro-batches ({_shown(a)} vs {_shown(b)}) beyond their "
        "rows on dimension 0, so the micro-batches' caches cannot be joined into one; use "
        "chunks=1, or pass use_cache=False"
    )


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return reprlib.repr(value)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


# -- detaching ----------------------------------------------------------------------------------
def _detach(value: Any) -> Any:
    """``value`` with its tensors detached; states, lists and dicts are updated in place."""
    if isinstance(value, Tensor):
        return value.detach()
    if _is_state(value):
        for name, v in list(vars(value).items()):
            if name != _ORIGIN:
                value.__dict__[name] = _detach(v)
    elif type(value) is list:
        value[:] = [_detach(v) for v in value]
    elif type(value) is tuple:
        return tuple(_detach(v) for v in value)
    elif type(value) is dict:
        for k, v in list(value.items()):
            value[k] = _detach(v)
    return value


# -- recognizing --------------------------------------------------------------------------------
def _is_state(value: Any) -> bool:
    """A cache or one of its layers: an object whose attributes are walked."""
    types = _types(("Cache", *_LAYER_BASES))
    return bool(types) and isinstance(value, types) and hasattr(value, "__dict__")


def _types(names: Sequence[str]) -> tuple[type, ...]:
    """The classes ``names`` of ``transformers.cache_utils``, if the user's code imported it
    (no object can be a transformers cache otherwise)."""
    module = sys.modules.get("transformers.cache_utils")
    if module is None:
        return ()
    found = (getattr(module, name, None) for name in names)
    return tuple(t for t in found if isinstance(t, type))
