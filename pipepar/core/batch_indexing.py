"""The rows of the batch through indexing: ``x[...]`` read (``getitem``) and written
(``setitem``), basic (ints, slices, None, Ellipsis) and advanced (integer and boolean tensors,
lists), laid out as torch lays them out.

Indexing keeps the rows when it takes all of them in their order (``x[:, 0]``, ``x[..., None]``,
``x[torch.arange(len(x)), idx]``, ``x[mask]`` with a mask computed row by row), moves them where
the index puts them (``table[ids]``: the rows of ``ids``), and mixes them when it takes rows by
their position (``x[0]``, ``x[1:]``, ``x[[2, 0]]``, a constant mask): a micro-batch's row 0 is
not the batch's. An index that is a value of the batch whose rows are not followed (indices a
router computed) is trusted to index the micro-batch's own rows: the rows are not followed
further.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipepar.core.batch_outcome import Batched, Coupling, Outcome, dim_of

__all__ = ["indexed", "written"]

_POSITION = Coupling("getitem", "it takes rows of the batch by their position")


@dataclass(frozen=True)
class _Item:
    """One entry of an index: what it is and the input dimensions it takes."""

    value: Any
    first: int  # the first input dimension it takes
    takes: int  # how many input dimensions it takes
    advanced: bool


def _items(x: Tensor, index: Any) -> list[_Item]:
    entries = list(index) if isinstance(index, tuple) else [index]
    entries = [torch.tensor(e) if isinstance(e, list) else e for e in entries]
    tensors = any(isinstance(e, Tensor) for e in entries)

    def takes(e: Any) -> int:
        if e is None or e is Ellipsis:
            return 0
        return e.dim() if isinstance(e, Tensor) and e.dtype == torch.bool else 1

    rest = x.dim() - sum(takes(e) for e in entries)
    items, first = [], 0
    for e in entries:
        if e is Ellipsis:
            items += [_Item(slice(None), first + k, 1, False) for k in range(rest)]
            first += rest
            continue
        advanced = isinstance(e, Tensor) or (tensors and isinstance(e, int))
        items.append(_Item(e, first, takes(e), advanced))
        first += takes(e)
    items += [_Item(slice(None), first + k, 1, False) for k in range(x.dim() - first)]
    return items


def _layout(items: list[_Item]) -> tuple[dict[int, int], int]:
    """Where each basic item's result dimension goes (by item position), and where the
    advanced indices' broadcast dimensions start."""
    advanced = [k for k, i in enumerate(items) if i.advanced]
    adjacent = not advanced or advanced == list(range(advanced[0], advanced[-1] + 1))
    shapes = [i.value.shape for i in items if isinstance(i.value, Tensor)]
    n_adv = len(torch.broadcast_shapes(*shapes)) if shapes else 0
    out, positions, start = 0, {}, 0
    if advanced and not adjacent:
        out = n_adv  # the advanced dimensions first
    for k, item in enumerate(items):
        if advanced and adjacent and k == advanced[0]:
            start, out = out, out + n_adv
        if not item.advanced and not isinstance(item.value, int):
            positions[k] = out
            out += 1
    return positions, start if adjacent else 0


def _full(s: slice, size: int) -> bool:
    return s.start in (None, 0) and s.step in (None, 1) and (s.stop is None or s.stop >= size)


def _arange_dim(t: Tensor, rows: int) -> int | None:
    """The dimension of ``t`` along which it counts 0, 1, ... rows-1 (and is that alone)."""
    if t.is_floating_point() or t.dtype == torch.bool:
        return None
    long = [k for k, n in enumerate(t.shape) if n != 1]
    if len(long) != 1 or t.shape[long[0]] != rows:
        return None
    return long[0] if torch.equal(t.reshape(-1).cpu(), torch.arange(rows)) else None


def indexed(
    x: Tensor, index: Any, batched: Sequence[Batched], loose: Sequence[Tensor] = ()
) -> Outcome:
    """Where the rows are in ``x[index]``; ``loose``: values of the batch whose rows are
    not followed (trusted to index the micro-batch's own rows)."""
    items = _items(x, index)
    positions, start = _layout(items)
    shapes = [i.value.shape for i in items if isinstance(i.value, Tensor)]
    n_adv = len(torch.broadcast_shapes(*shapes)) if shapes else 0
    found: set[int] = set()
    d = dim_of(x, batched)
    for k, item in enumerate(items):
        value = item.value
        if isinstance(value, Tensor):
            if any(value is v for v in loose):
                return None  # a router's indices: trusted, not followed
            di = dim_of(value, batched)
            if di is not None:
                found.add(start + di + n_adv - value.dim())
        if d is None or not item.first <= d < item.first + max(item.takes, 1) or not item.takes:
            continue
        if isinstance(value, slice):
            if not _full(value, x.shape[d]):
                return _POSITION
            found.add(positions[k])
        elif isinstance(value, Tensor) and value.dtype == torch.bool:
            if dim_of(value, batched) != 0 or d != item.first:
                return _POSITION  # a constant mask, or one not cut along the rows
        elif isinstance(value, Tensor) and value.device.type == "meta":
            return None  # a shadow's index: its values are not there to read
        elif isinstance(value, Tensor) and dim_of(value, batched) is None:
            a = _arange_dim(value, x.shape[d])
            if a is None:
                return _POSITION
            found.add(start + a + n_adv - value.dim())
        elif not isinstance(value, Tensor):
            return Coupling("getitem", "it picks a row of the batch by its position")
    if len(found) > 1:
        return Coupling("getitem", "it pairs every row of the batch with every other")
    return found.pop() if found else None


def written(
    x: Tensor, index: Any, value: Any, batched: Sequence[Batched], loose: Sequence[Tensor] = ()
) -> Outcome:
    """``x[index] = value``: where the rows of ``x`` are after it; writing rows by their
    position (``x[0] = ...``) is a :class:`Coupling`."""
    d = dim_of(x, batched)
    if d is not None:
        outcome = indexed(x, index, batched, loose)
        return outcome if isinstance(outcome, Coupling) else d
    dv = dim_of(value, batched)
    if dv is None or not isinstance(value, Tensor):
        return None
    items = _items(x, index)
    if any(i.advanced for i in items):
        return None
    view = [i for i in items if not isinstance(i.value, int)]  # the view's dims, in order
    e = dv + len(view) - value.dim()
    kept = view[e].value if 0 <= e < len(view) else None
    if kept is None or not _full(kept, x.shape[view[e].first]):
        return Coupling("setitem", "it writes rows of the batch into positions")
    return view[e].first
