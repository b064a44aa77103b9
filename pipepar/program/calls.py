"""Split a model call into micro-batch calls, and join what they return.

A call is the positional and keyword arguments a model takes (``input_ids=..., labels=...``).
Every tensor argument whose dimension 0 has the batch size is split into ``m`` row views; every
other argument (a flag, a config, a tensor without the batch) goes unchanged to each
micro-batch. The batch size is dimension 0 of the first tensor argument. A transformers
key-value cache, passed in or returned, is split and joined like a tensor of the batch
(:mod:`pipepar.program.caches`).

Outputs are joined leaf by leaf (tensors, tuples, dicts and transformers' ``ModelOutput``):
tensors with the micro-batch's rows are concatenated; a one-element tensor (a loss averaged
over the micro-batch) becomes the average weighted by rows, or for the loss by the shares of
:mod:`pipepar.core.losses`; ``None`` and equal plain values stay;
anything else cannot be joined and raises.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from pipepar.core.given import Given
from pipepar.core.losses import Items, split_target, weighted_sum
from pipepar.program import caches

__all__ = ["Call", "StepCall", "as_call", "given_calls", "join", "split_call"]


@dataclass
class Call:
    """One micro-batch's arguments."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: int
    batched: frozenset[int] = frozenset()
    """Which leaves of ``(args, kwargs)`` are this micro-batch's rows of a batch tensor."""

    def tensors(self) -> list[Tensor]:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return [t for t in leaves if isinstance(t, Tensor)]

    def batch_tensors(self) -> list[Tensor]:
        """The tensors holding this micro-batch's rows (the others go whole to each)."""
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return [t for k, t in enumerate(leaves) if k in self.batched and isinstance(t, Tensor)]


@dataclass(frozen=True)
class StepCall:
    """What ``pipe.step(...)`` of a model was given: the model's arguments, and what its loss
    is (``loss_fn(output, target)``, or the model's own without ``loss_fn``; ``items`` counts
    what a custom loss averages over)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Any = None
    target: Any = None
    items: Items | None = None
    scale: float = 1.0
    """A loss scaler's scale: each micro-batch's backward seed is multiplied by it."""
    given: Given | None = None
    """The micro-batches (and targets) the caller made, in place of ``args``, ``kwargs``
    (and ``target``)."""

    def microbatches(self, chunks: int) -> tuple[list[Call], list[Any]]:
        """The micro-batch calls (the batch split into at most ``chunks``, or the caller's)
        and each one's target."""
        if self.given is not None:
            return given_calls(self.given.microbatches), self.given.targets_on(None)
        calls = split_call(self.args, self.kwargs, chunks)
        return calls, split_target(self.target, [c.rows for c in calls])


def as_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample as a call: a dict is keyword arguments, a tuple positional ones, anything
    else the one positional argument."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError(
        "the call has no tensor argument with a batch dimension to split into micro-batches; "
        "pass the batch as a tensor (e.g. input_ids=...) with the samples on dimension 0"
    )


def split_call(args: tuple[Any, ...], kwargs: dict[str, Any], chunks: int) -> list[Call]:
    """The calls of at most ``chunks`` micro-batches (fewer if the batch has fewer rows).

    Example:
        >>> calls = split_call((torch.zeros(5, 2),), {"flag": True}, 2)
        >>> [(c.args[0].shape[0], c.kwargs["flag"]) for c in calls]
        [(3, True), (2, True)]
    """
    n = batch_size(args, kwargs)
    m = max(1, min(chunks, n))
    leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=caches.is_cache)
    columns = [_split_leaf(leaf, n, m) for leaf in leaves]
    rows = [len(r) for r in torch.arange(n).tensor_split(m)]
    batched = _batched_leaves(leaves, n, spec)
    calls = []
    for i in range(m):
        a, k = pytree.tree_unflatten([col[i] for col in columns], spec)
        calls.append(Call(tuple(a), dict(k), rows[i], batched))
    return calls


def given_calls(microbatches: Sequence[Any]) -> list[Call]:
    """The calls of micro-batches the caller made, each read as :func:`as_call` reads a
    sample (a dict: keyword arguments, a tuple: positional ones); a micro-batch's rows are
    dimension 0 of its first tensor; its batch tensors are the arguments that have its rows
    there in every micro-batch.

    Raises:
        ValueError: micro-batches with different arguments, or one without rows.

    Example:
        >>> calls = given_calls([{"x": torch.zeros(2, 5)}, {"x": torch.zeros(1, 7)}])
        >>> [c.rows for c in calls]
        [2, 1]
    """
    made = [as_call(mb) for mb in microbatches]
    flat = [pytree.tree_flatten(call, is_leaf=caches.is_cache) for call in made]
    calls = []
    for i, ((args, kwargs), (leaves, spec)) in enumerate(zip(made, flat)):
        if spec != flat[0][1]:
            raise ValueError(
                f"microbatches[{i}] passes the model {_arguments(args, kwargs)} but "
                f"microbatches[0] {_arguments(*made[0])}; give every micro-batch the same "
                "arguments, in the same structure (only their tensors' sizes may differ)"
            )
        n = batch_size(args, kwargs)
        if n == 0:
            raise ValueError(
                f"microbatches[{i}] has no rows (dimension 0 of its first tensor is 0); leave "
                "empty micro-batches out of the list"
            )
        calls.append(Call(tuple(args), dict(kwargs), n, _batched_leaves(leaves, n, spec)))
    # The same leaves hold rows in every micro-batch: counts are replayed by position.
    batched = frozenset.intersection(*(c.batched for c in calls))
    return [dataclasses.replace(c, batched=batched) for c in calls]


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return f"{len(args)} positional arguments and keywords {sorted(kwargs)}"


def _batched_leaves(leaves: list[Any], n: int, spec: pytree.TreeSpec) -> frozenset[int]:
    """Positions, among the plain leaves of a micro-batch's call, of the split batch tensors."""
    marks = pytree.tree_leaves(
        pytree.tree_unflatten([_batched(leaf, n) for leaf in leaves], spec)
    )
    return frozenset(k for k, mark in enumerate(marks) if mark is True)


def _split_leaf(leaf: Any, n: int, m: int) -> Sequence[Any]:
    if caches.is_cache(leaf):  # a key-value cache passed back in (generation's decode steps)
        return caches.split(leaf, n, m)
    return leaf.tensor_split(m) if _batched(leaf, n) else [leaf] * m


def _batched(leaf: Any, n: int) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == n


def join(
    outputs: Sequence[Any],
    rows: Sequence[int],
    shares: dict[int, Sequence[float]] | None = None,
) -> Any:
    """Join the micro-batch outputs into the output of the whole batch.

    Args:
        outputs: what each micro-batch's call returned.
        rows: each micro-batch's rows.
        shares: for the leaves reduced over the batch (by index among the output's leaves),
            the micro-batches' shares (see :mod:`pipepar.core.losses`); a share of 0 leaves
            that micro-batch's value out (a mean over nothing). Other one-element leaves are
            averaged by rows.
    """
    shares = shares or {}
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for k, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(
                f"micro-batch {k} returned a differently shaped output than micro-batch 0 "
                f"({other} vs {spec}); the model must return the same structure for every batch"
            )
    columns = list(zip(*(leaves for leaves, _ in flat)))
    total = sum(rows)
    by_rows = [r / total for r in rows]
    joined = [
        _join_leaf(col, rows, list(shares[k]) if k in shares else by_rows, path)
        for k, (path, col) in enumerate(zip(_paths(spec, len(columns)), columns))
    ]
    return pytree.tree_unflatten(joined, spec)


def _join_leaf(col: Sequence[Any], rows: Sequence[int], shares: Sequence[float], where: str) -> Any:
    first = col[0]
    if isinstance(first, Tensor):
        if all(
            isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == r for t, r in zip(col, rows)
        ):
            return torch.cat(list(col))
        if all(isinstance(t, Tensor) and t.numel() == 1 for t in col):
            return weighted_sum(col, shares)
        shapes = [tuple(t.shape) for t in col]
        raise ValueError(
            f"output {where} cannot be joined over micro-batches: shapes {shapes} neither carry "
            f"the micro-batch rows {list(rows)} on dimension 0 nor hold one value; return it "
            "with the batch on dimension 0, or use chunks=1"
        )
    if caches.is_cache(first):
        return caches.join(col, rows, f"output {where}")
    if all(v is None for v in col) or all(_same(v, first) for v in col):
        return first
    other = next(v for v in col if not _same(v, first))
    raise ValueError(
        f"output {where} differs between micro-batches ({reprlib.repr(first)} vs "
        f"{reprlib.repr(other)}) and a {type(first).__name__} cannot be joined (tensors, "
        "transformers caches and equal plain values can); leave it out of the output or use "
        "chunks=1 (for a cache of a kind of the model's own, pass use_cache=False)"
    )


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
