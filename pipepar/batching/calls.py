"""Split a model call into micro-batch calls (their outputs are joined by
:mod:`pipepar.batching.joins`).

A call is the positional and keyword arguments a model takes (``input_ids=..., labels=...``).
Every tensor argument whose dimension 0 has the batch size is split into ``m`` row views; every
other argument (a flag, a config, a tensor without the batch) goes unchanged to each
micro-batch. The batch size is dimension 0 of the first tensor argument. A transformers
key-value cache, passed in or returned, is split and joined like a tensor of the batch
(:mod:`pipepar.batching.caches`).

A one-row batch of packed documents (restarting position ids, ``cu_seqlens``) is cut at
document boundaries instead (:mod:`pipepar.batching.documents`): its units are documents, the
micro-batches' sizes are tokens, on dimension 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching import caches, documents, packed_inputs
from pipepar.batching.rules import (
    Rule,
    Rules,
    argument_keys,
    packed_pieces,
    row_lengths,
)
from pipepar.core.given import Given
from pipepar.core.losses import Items, split_target

__all__ = [
    "Call",
    "Parts",
    "StepCall",
    "as_call",
    "batch_size",
    "given_calls",
    "parts_of",
    "split_call",
]


@dataclass(frozen=True)
class Parts:
    """How a batch was cut: each micro-batch's size on the cut's dimension ``dim`` (its rows,
    or under a document cut its tokens on dimension 1), the sizes of its packed inputs (per
    packed tensor, each micro-batch's size on the packed dimension) and the pipe's rules."""

    rows: tuple[int, ...]
    packed: tuple[tuple[int, ...], ...] = ()
    rules: Rules = field(default_factory=Rules)
    dim: int = 0
    documents: tuple[tuple[int, ...], ...] = ()
    """Under a document cut, each micro-batch's documents' lengths."""
    whole: tuple[Tensor, ...] = field(default=(), compare=False)
    """Under a document cut, the whole batch's tensors in the order of
    :meth:`Call.batch_tensors` (what a loss's count is replayed on, to check the cut)."""


@dataclass
class Call:
    """One micro-batch's arguments."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: int
    batched: frozenset[int] = frozenset()
    """Which leaves of ``(args, kwargs)`` are this micro-batch's rows of a batch tensor."""
    packed: frozenset[int] = frozenset()
    """Which leaves are this micro-batch's part of a packed (or custom-split) argument."""
    parts: Parts | None = None
    absent: tuple[tuple[int, Tensor], ...] = ()
    """Leaves passed as ``None`` (a recognised packed input this micro-batch holds no item
    of, :mod:`pipepar.batching.packed_inputs`): their index and the empty part they stand for."""

    def _leaves(self) -> list[Any]:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        for k, empty in self.absent:
            leaves[k] = empty
        return leaves

    def tensors(self) -> list[Tensor]:
        return [t for t in self._leaves() if isinstance(t, Tensor)]

    def batch_tensors(self) -> list[Tensor]:
        """The tensors holding this micro-batch's part of the batch (the others go whole to
        each): its row blocks first (:meth:`tracked` of them), then its packed parts."""
        leaves = self._leaves()
        rows = [t for k, t in enumerate(leaves) if k in self.batched and isinstance(t, Tensor)]
        packed = [t for k, t in enumerate(leaves) if k in self.packed and isinstance(t, Tensor)]
        return rows + packed

    def cache_tensors(self) -> list[Tensor]:
        """The tensors of the key-value caches among this micro-batch's arguments (its rows of
        the caller's cache, or the cache itself when there is one micro-batch)."""
        leaves = self._leaves()
        return [t for leaf in leaves if caches.is_cache(leaf) for t in caches.tensors_of(leaf)]

    def tracked(self) -> int:
        """How many of :meth:`batch_tensors` hold rows on dimension 0."""
        leaves = self._leaves()
        return sum(1 for k, t in enumerate(leaves) if k in self.batched and isinstance(t, Tensor))


def parts_of(calls: Sequence[Call]) -> Parts:
    """How the batch of ``calls`` was cut (rows only for calls made without rules)."""
    if calls and calls[0].parts is not None:
        return calls[0].parts
    return Parts(tuple(c.rows for c in calls))


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

    def microbatches(
        self, chunks: int, rules: Rules | None = None, model: nn.Module | None = None
    ) -> tuple[list[Call], list[Any]]:
        """The micro-batch calls (the batch split into at most ``chunks`` by ``rules``, or
        the caller's) and each one's target."""
        if self.given is not None:
            return given_calls(self.given.microbatches), self.given.targets_on(None)
        calls = split_call(self.args, self.kwargs, chunks, rules, model)
        if self.loss_fn is not None and parts_of(calls).dim != 0:
            raise ValueError(
                "pipe.step(loss_fn=..., target=...) was given one row of packed documents, cut "
                f"at document boundaries into {len(calls)} micro-batches: a target is cut by "
                "rows only; pass the labels to the model (its own loss is checked for the cut), "
                "or chunks=1"
            )
        return calls, split_target(self.target, [c.rows for c in calls])


def as_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample as a call: a dict is keyword arguments, a tuple positional ones, anything
    else the one positional argument."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


def split_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    chunks: int,
    rules: Rules | None = None,
    model: nn.Module | None = None,
) -> list[Call]:
    """The calls of at most ``chunks`` micro-batches (fewer if the batch has fewer rows).

    Args:
        args, kwargs: the batch's call.
        chunks: the micro-batches to cut it into.
        rules: how each argument is cut (:mod:`pipepar.batching.rules`); without one, a
            tensor with the batch's rows on dimension 0 is cut into row blocks and anything
            else goes whole to every micro-batch.
        model: whose parameter names the rules use (positions without it); its config's
            placeholder tokens recognise the packed inputs of a multimodal model
            (:mod:`pipepar.batching.packed_inputs`).

    Example:
        >>> calls = split_call((torch.zeros(5, 2),), {"flag": True}, 2)
        >>> [(c.args[0].shape[0], c.kwargs["flag"]) for c in calls]
        [(3, True), (2, True)]
    """
    rules = rules or Rules()
    keys: list[str | int] = (
        argument_keys(model, args, kwargs) if model is not None else [*range(len(args)), *kwargs]
    )
    values = [*args, *kwargs.values()]
    given = [rules.input(key) if rules.inputs else None for key in keys]
    cut_documents = documents.find(keys, values, given, chunks)
    if cut_documents is not None:
        return _split_documents(args, kwargs, keys, given, cut_documents, chunks, rules)
    n = _batch_size(keys, values, given)
    found = packed_inputs.recognised(model, keys, values, given, n) if model is not None else None
    if found:  # the packed inputs of a multimodal model, under what the caller said
        rules = rules.with_defaults(found.rules)
        given = [rules.input(key) for key in keys]
    m = max(1, min(chunks, n))
    pieces = [range(int(r[0]), int(r[-1]) + 1) if len(r) else range(0) for r in _blocks(n, m)]
    whole: dict[str | int, Any] | None = None
    parts, marks, packed_sizes = [], [], []
    for key, value, rule in zip(keys, values, given):
        if rule is not None and rule.name == "packed" and whole is None:
            whole = dict(zip(keys, values))
        split = _split_argument(key, value, rule, n, pieces, whole)
        parts.append(split.values)
        marks.extend(split.marks)
        packed_sizes.extend(split.sizes)
    batched = frozenset(k for k, mark in enumerate(marks) if mark == "rows")
    packed = frozenset(k for k, mark in enumerate(marks) if mark == "packed")
    if found:  # each micro-batch's placeholders: what outputs per image token are packed like
        packed_sizes.extend(found.placeholders_of(pieces))
    cut = Parts(tuple(len(p) for p in pieces), tuple(packed_sizes), rules)
    calls = []
    for i in range(m):
        a = tuple(parts[k][i] for k in range(len(args)))
        kw = {name: parts[len(args) + j][i] for j, name in enumerate(kwargs)}
        calls.append(Call(a, kw, len(pieces[i]), batched, packed, cut))
    return found.absent_when_empty(calls, pieces) if found else calls


def _split_documents(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    keys: list[str | int],
    given: list[Rule | None],
    cut: documents.DocumentCut,
    chunks: int,
    rules: Rules,
) -> list[Call]:
    """The calls of a one-row batch of packed documents cut at document boundaries."""
    pieces = documents.balanced(cut.lengths, chunks)
    columns, marks = [], []
    for key, value, rule in zip(keys, [*args, *kwargs.values()], given):
        split = _split_by_documents(key, value, rule, cut, pieces)
        columns.append(split.values)
        marks.extend(split.marks)
    packed = frozenset(k for k, mark in enumerate(marks) if mark == "packed")
    leaves = pytree.tree_leaves((args, kwargs))
    tokens = tuple(sum(cut.lengths[p.start : p.stop]) for p in pieces)
    parts = Parts(
        tokens,
        rules=rules,
        dim=documents.SEQUENCE_DIM,
        documents=tuple(cut.lengths[p.start : p.stop] for p in pieces),
        whole=tuple(t for k, t in enumerate(leaves) if k in packed and isinstance(t, Tensor)),
    )
    calls = []
    for i, size in enumerate(tokens):
        a = tuple(columns[k][i] for k in range(len(args)))
        kw = {name: columns[len(args) + j][i] for j, name in enumerate(kwargs)}
        calls.append(Call(a, kw, size, frozenset(), packed, parts))
    return calls


def _split_by_documents(
    key: str | int, value: Any, rule: Rule | None, cut: documents.DocumentCut, pieces: list[range]
) -> _Split:
    """One argument under a document cut: whole, by its function of the documents' ranges, or
    leaf by leaf as :func:`pipepar.batching.documents.split_value` says."""
    m = len(pieces)
    if rule is not None and rule.name in ("rows", "packed"):
        raise ValueError(
            f"split_inputs gives argument {key!r} the rule {rule.name!r}, but the batch is one "
            f"row of {len(cut.lengths)} packed documents, cut at document boundaries; give it "
            "'whole', pipepar.Documents() or fn(value, pieces) (pieces: each micro-batch's "
            "documents), or cut by rows: a batch of several rows, or chunks=1"
        )
    if rule is not None and rule.name == "whole":
        return _Split([value] * m, [None] * len(pytree.tree_leaves(value)), [])
    if rule is not None and rule.custom is not None:
        return _split_custom(key, value, rule, pieces)
    leaves, spec = pytree.tree_flatten(value)
    role = cut.roles.get(key)
    split = [documents.split_value(key, t, role, cut, pieces) for t in leaves]
    values = [pytree.tree_unflatten([col[i] for col, _ in split], spec) for i in range(m)]
    return _Split(values, ["packed" if own else None for _, own in split], [])


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Dimension 0 of the call's first tensor: the rows of its batch."""
    values = [*args, *kwargs.values()]
    return _batch_size([*range(len(args)), *kwargs], values, [None] * len(values))


def _blocks(n: int, m: int) -> list[Tensor]:
    return list(torch.arange(n).tensor_split(m)) if n else [torch.arange(0)]


def _batch_size(keys: list[str | int], values: list[Any], given: list[Rule | None]) -> int:
    """Dimension 0 of the first tensor of an argument cut into rows (by default, or said)."""
    for key, value, rule in zip(keys, values, given):
        if rule is not None and rule.name != "rows":
            continue
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, Tensor) and leaf.dim() > 0:
                return leaf.shape[0]
        if rule is not None:
            raise ValueError(
                f"split_inputs says argument {key!r} holds rows, but it has no tensor with a "
                "dimension 0 to cut; pass the batch there, or its rule as 'whole'"
            )
    raise ValueError(
        "the call has no tensor argument with a batch dimension to split into micro-batches; "
        "pass the batch as a tensor (e.g. input_ids=...) with the samples on dimension 0"
    )


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


@dataclass
class _Split:
    values: list[Any]
    """The argument's value in each micro-batch."""
    marks: list[str | None]
    """Per leaf of a micro-batch's value: ``"rows"``, ``"packed"`` or None (whole)."""
    sizes: list[tuple[int, ...]]
    """Per packed tensor leaf, each micro-batch's size on the packed dimension."""


def _split_argument(
    key: str | int,
    value: Any,
    rule: Rule | None,
    n: int,
    pieces: list[range],
    whole: dict[str | int, Any] | None,
) -> _Split:
    m = len(pieces)
    if rule is None:
        return _split_by_default(value, n, m)
    if rule.name == "whole":
        return _Split([value] * m, [None] * len(pytree.tree_leaves(value)), [])
    if rule.name == "rows":
        return _split_rows(key, value, n, m)
    if rule.name == "packed":
        assert rule.packed is not None and whole is not None
        lengths = row_lengths(rule.packed, whole, n, key)
        leaves, spec = pytree.tree_flatten(value)
        columns = [
            packed_pieces(t, rule.packed, lengths, pieces, key)
            if isinstance(t, Tensor)
            else [t] * m
            for t in leaves
        ]
        values = [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(m)]
        marks: list[str | None] = ["packed" if isinstance(t, Tensor) else None for t in leaves]
        dim = rule.packed.dim
        sizes = [tuple(p.shape[dim] for p in col) for col in columns if isinstance(col[0], Tensor)]
        return _Split(values, marks, sizes)
    return _split_custom(key, value, rule, pieces)


def _split_custom(key: str | int, value: Any, rule: Rule, pieces: list[range]) -> _Split:
    m = len(pieces)
    assert rule.custom is not None
    values = list(rule.custom(value, pieces))
    if len(values) != m:
        raise ValueError(
            f"the split function of argument {key!r} returned {len(values)} values for "
            f"{m} micro-batches; return one value per range of rows it is given"
        )
    leaves = [pytree.tree_leaves(v) for v in values]
    marks = ["packed" if isinstance(t, Tensor) else None for t in leaves[0]]
    sizes = [
        tuple(col[k].shape[0] for col in leaves)
        for k, t in enumerate(leaves[0])
        if isinstance(t, Tensor) and t.dim() > 0
    ]
    return _Split(values, marks, sizes)


def _split_by_default(value: Any, n: int, m: int) -> _Split:
    """Tensors with the batch's rows cut into row blocks, key-value caches by rows, anything
    else whole."""
    leaves, spec = pytree.tree_flatten(value, is_leaf=caches.is_cache)
    columns = [_split_leaf(leaf, n, m) for leaf in leaves]
    values = [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(m)]
    flags = pytree.tree_leaves(pytree.tree_unflatten([_batched(t, n) for t in leaves], spec))
    return _Split(values, ["rows" if flag is True else None for flag in flags], [])


def _split_rows(key: str | int, value: Any, n: int, m: int) -> _Split:
    leaves, spec = pytree.tree_flatten(value)
    for t in leaves:
        if isinstance(t, Tensor) and not _batched(t, n):
            raise ValueError(
                f"split_inputs says argument {key!r} holds rows, but it has shape "
                f"{tuple(t.shape)} for a batch of {n} rows; give it the rows on dimension 0, "
                "or its rule as 'whole' or pipepar.Packed(lengths)"
            )
    columns = [_split_leaf(t, n, m) for t in leaves]
    values = [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(m)]
    return _Split(values, ["rows" if isinstance(t, Tensor) else None for t in leaves], [])


def _split_leaf(leaf: Any, n: int, m: int) -> Sequence[Any]:
    if caches.is_cache(leaf):  # a key-value cache passed back in (generation's decode steps)
        return caches.split(leaf, n, m)
    return leaf.tensor_split(m) if _batched(leaf, n) else [leaf] * m


def _batched(leaf: Any, n: int) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == n
