"""Join what the micro-batch calls of a model return into the output of the whole batch.

Outputs are joined leaf by leaf (tensors, tuples, dicts and transformers' ``ModelOutput``), by
the pipe's ``join_outputs`` rule for the leaf or else by what its values are: tensors with the
micro-batch's rows (or, under a document cut, its tokens) are concatenated; a one-element
tensor (a loss averaged over the micro-batch) becomes the average weighted by rows, or for a
loss by the shares of :mod:`pipepar.core.losses`; a tensor packed like a packed input is
concatenated in micro-batch order; ``None`` and equal plain values stay; anything else cannot
be joined and raises. Each leaf's :class:`LeafJoin` also says how its gradient goes back.
"""

from __future__ import annotations

import functools
import operator
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from pipepar.batching import caches, packed_inputs
from pipepar.batching.calls import Parts
from pipepar.batching.rules import first_key
from pipepar.core.losses import weighted_sum

__all__ = ["LeafJoin", "join", "join_with"]


@dataclass(frozen=True)
class LeafJoin:
    """How one output leaf is joined over micro-batches, and its gradient handed back:
    ``"concat"`` on ``dim`` (each micro-batch's size there in ``sizes``), ``"shares"`` (one
    value, each micro-batch weighted), ``"sum"``, ``"custom"`` (a function of the values),
    ``"same"`` (equal plain values), ``"cache"``."""

    kind: str
    dim: int = 0
    sizes: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    custom: Any = None


def join(
    outputs: Sequence[Any],
    parts: Parts | Sequence[int],
    shares: dict[int, Sequence[float]] | None = None,
) -> Any:
    """Join the micro-batch outputs into the output of the whole batch.

    Args:
        outputs: what each micro-batch's call returned.
        parts: how the batch was cut (:func:`parts_of`), or each micro-batch's rows.
        shares: for the leaves reduced over the batch (by index among the output's leaves),
            the micro-batches' shares (see :mod:`pipepar.core.losses`); a share of 0 leaves
            that micro-batch's value out (a mean over nothing). Other one-element leaves are
            averaged by rows.
    """
    return join_with(outputs, parts, shares)[0]


def join_with(
    outputs: Sequence[Any],
    parts: Parts | Sequence[int],
    shares: dict[int, Sequence[float]] | None = None,
) -> tuple[Any, list[LeafJoin]]:
    """:func:`join`, and how each leaf was joined (what hands its gradient back)."""
    cut = parts if isinstance(parts, Parts) else Parts(tuple(parts))
    shares = shares or {}
    outputs = packed_inputs.aligned(outputs)
    if len(outputs) == 1:
        leaves = pytree.tree_leaves(outputs[0])
        return outputs[0], [LeafJoin("single") for _ in leaves]
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for k, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(
                f"micro-batch {k} returned a differently shaped output than micro-batch 0 "
                f"({other} vs {spec}); the model must return the same structure for every batch"
            )
    columns = list(zip(*(leaves for leaves, _ in flat)))
    total = sum(cut.rows)
    by_rows = tuple(r / total for r in cut.rows) if total else tuple(1.0 for _ in cut.rows)
    ways = [
        _how(col, cut, tuple(shares[k]) if k in shares else by_rows, path)
        for k, (path, col) in enumerate(zip(_paths(spec, len(columns)), columns))
    ]
    joined = [
        _apply(way, col, cut.rows, path)
        for way, col, path in zip(ways, columns, _paths(spec, len(columns)))
    ]
    return pytree.tree_unflatten(joined, spec), ways


def _how(col: Sequence[Any], cut: Parts, shares: tuple[float, ...], where: str) -> LeafJoin:
    """How a leaf is joined: by the pipe's rule for it, else by what its values are."""
    rule = cut.rules.output(where)
    first = col[0]
    if rule == "concat":
        _check_concat(col, where)
        return LeafJoin("concat", 0, tuple(t.shape[0] for t in col))
    if rule == "sum":
        return LeafJoin("sum")
    if rule is not None:
        return LeafJoin("custom", custom=rule)
    if isinstance(first, Tensor):
        d = cut.dim
        if all(
            isinstance(t, Tensor) and t.dim() > d and t.shape[d] == r for t, r in zip(col, cut.rows)
        ):
            return LeafJoin("concat", d, tuple(cut.rows))
        if all(isinstance(t, Tensor) and t.numel() == 1 for t in col):
            return LeafJoin("shares", weights=shares)
        if _packed_like(col, cut):
            return LeafJoin("concat", 0, tuple(t.shape[0] for t in col))
        shapes = [tuple(t.shape) for t in col]
        raise ValueError(
            f"output {where} cannot be joined over micro-batches: shapes {shapes} neither carry "
            f"the micro-batch {_unit(cut)} {list(cut.rows)} on dimension {cut.dim} nor hold one "
            f"value; return it with the batch on dimension {cut.dim}, say how to join it "
            "(wrap(..., join_outputs="
            f"{{{first_key(where)!r}: 'concat'}}) or 'sum' or a function), or use chunks=1"
        )
    if caches.is_cache(first) and cut.dim != 0:
        raise ValueError(
            f"output {where} is a key-value cache of each micro-batch's documents, which pipepar "
            "joins by rows only, and this batch was cut at document boundaries; pass "
            "use_cache=False (training does not read the cache), or chunks=1"
        )
    if caches.is_cache(first):
        return LeafJoin("cache")
    if all(v is None for v in col) or all(_same(v, first) for v in col):
        return LeafJoin("same")
    other = next(v for v in col if not _same(v, first))
    raise ValueError(
        f"output {where} differs between micro-batches ({reprlib.repr(first)} vs "
        f"{reprlib.repr(other)}) and a {type(first).__name__} cannot be joined (tensors, "
        "transformers caches and equal plain values can); leave it out of the output, say how "
        f"to join it (join_outputs={{{first_key(where)!r}: fn}}) or use chunks=1 (for a "
        "cache of a kind of the model's own, pass use_cache=False)"
    )


def _unit(cut: Parts) -> str:
    return "tokens" if cut.documents else "rows"


def _apply(way: LeafJoin, col: Sequence[Any], rows: Sequence[int], where: str) -> Any:
    if way.kind == "single":
        return col[0]
    if way.kind == "concat":
        return torch.cat(list(col), dim=way.dim)
    if way.kind == "shares":
        return weighted_sum(col, way.weights)
    if way.kind == "sum":
        return functools.reduce(operator.add, col)
    if way.kind == "custom":
        return way.custom(list(col))
    if way.kind == "cache":
        return caches.join(col, rows, f"output {where}")
    return col[0]


def _check_concat(col: Sequence[Any], where: str) -> None:
    if not all(isinstance(t, Tensor) and t.dim() > 0 for t in col):
        kinds = [type(t).__name__ if not isinstance(t, Tensor) else tuple(t.shape) for t in col]
        raise ValueError(
            f"join_outputs says output {where} is concatenated, but the micro-batches returned "
            f"{kinds}; concatenate tensors of one dimension or more, or give a function"
        )


def _packed_like(col: Sequence[Any], cut: Parts) -> bool:
    """Whether each micro-batch's dimension 0 is in one proportion to its part of a packed
    input (an image's hidden states for each image, or for each patch)."""
    if not all(isinstance(t, Tensor) and t.dim() > 0 for t in col):
        return False
    sizes = [t.shape[0] for t in col]
    for packed in cut.packed:
        ref = next((i for i, p in enumerate(packed) if p > 0), None)
        if ref is None or sizes[ref] == 0:
            continue
        if all(s * packed[ref] == sizes[ref] * p for s, p in zip(sizes, packed)):
            return True
    return False


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def _paths(spec: pytree.TreeSpec, n: int) -> list[str]:
    """A readable name per leaf (its key path), for errors."""
    try:
        dummy = pytree.tree_unflatten(list(range(n)), spec)
        paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(dummy)[0]]
        return paths if len(paths) == n else [f"#{k}" for k in range(n)]
    except Exception:
        return [f"#{k}" for k in range(n)]
