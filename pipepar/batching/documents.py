"""A batch of packed documents, cut at document boundaries into micro-batches of balanced tokens.

Pretraining packs several documents into one row (transformers' ``DataCollatorWithFlattening``
makes a batch of one row): position ids restart at 0 for each document, or variable-length
attention is given the documents' offsets (``cu_seqlens``, ``[0, ..., T]``) and their longest
length. Such a batch has one row, so a cut by rows makes one micro-batch. Its units are the
documents instead: micro-batch ``i`` takes a run of whole documents whose tokens are as close to
``T / chunks`` as the boundaries allow, every ``(1, T, ...)`` tensor is cut on dimension 1, the
offsets are rebased to the micro-batch's first token and a longest length is recomputed.

The layout is read from the values of the call, never from names: an integer ``(1, T)`` tensor
whose values count ``0, 1, 2, ...`` and restart at 0 (at least twice), or a 1-D integer tensor
of increasing offsets from 0 to ``T``. :class:`~pipepar.batching.rules.Documents`
declares the argument to read them from, and an int declared so is the longest document's
length, recomputed per micro-batch. An int is never taken for that length by its value (it
could be another number equal to it by chance); left whole, it is the batch's longest, an upper
bound of every micro-batch's, which variable-length kernels accept. Whether cutting there is
exact (no attention across documents, no label crossing a cut) is checked at the first call
(:mod:`pipepar.core.document_mixing`, :mod:`pipepar.core.losses`), not assumed here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipepar.batching.rules import Packed, Rule, packed_pieces

__all__ = ["DocumentCut", "balanced", "find", "lengths_of", "split_value"]

SEQUENCE_DIM = 1
"""Where a one-row batch's tokens are: ``(1, T, ...)``."""


@dataclass(frozen=True)
class DocumentCut:
    """The documents of a one-row batch: their lengths in tokens, and the arguments that
    delimit them (by key), each read as ``"positions"``, ``"offsets"`` or ``"longest"``."""

    lengths: tuple[int, ...]
    roles: dict[str | int, str]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def lengths_of(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """The documents a value delimits: ``("positions", lengths)`` for restarting position ids
    of one row, ``("offsets", lengths)`` for ``cu_seqlens``; None for anything else.

    Example:
        >>> lengths_of(torch.tensor([[0, 1, 2, 0, 1]]))
        ('positions', (3, 2))
        >>> lengths_of(torch.tensor([0, 3, 5]))
        ('offsets', (3, 2))
    """
    if not isinstance(value, Tensor) or value.is_floating_point() or value.dtype == torch.bool:
        return None
    if value.device.type == "meta":
        return None
    if value.dim() == 2 and value.shape[0] == 1 and value.shape[1] > 1:
        return _positions(value[0])
    if value.dim() == 1 and value.numel() > 2:
        return _offsets(value)
    return None


def _positions(pos: Tensor) -> tuple[str, tuple[int, ...]] | None:
    if int(pos[0]) != 0:
        return None
    starts = (pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1
    if starts.numel() == 0 or bool((pos[starts] != 0).any()):
        return None  # one document, or a jump that is not a restart at 0
    if starts.numel() == pos.numel() - 1:
        return None  # every token its own document: zeros (token types), not positions
    edges = [0, *starts.tolist(), pos.numel()]
    return "positions", tuple(b - a for a, b in itertools.pairwise(edges))


def _offsets(off: Tensor) -> tuple[str, tuple[int, ...]] | None:
    steps = off[1:] - off[:-1]
    if int(off[0]) != 0 or bool((steps <= 0).any()):
        return None
    return "offsets", tuple(int(s) for s in steps.tolist())


def find(
    keys: Sequence[str | int], values: Sequence[Any], given: Sequence[Rule | None], chunks: int
) -> DocumentCut | None:
    """The documents of a call to cut by, or None (cut by rows): a one-row batch asked for
    several micro-batches whose packed layout is declared or recognised.

    Raises:
        ValueError: a declared argument that delimits no documents, or two that disagree.
    """
    declared = [k for k, rule in enumerate(given) if rule is not None and rule.name == "documents"]
    delimiting = [k for k in declared if not _is_int(values[k])]
    looked = delimiting + [k for k, rule in enumerate(given) if rule is None]
    found: dict[str | int, tuple[str, tuple[int, ...]]] = {}
    for k in looked:
        layout = lengths_of(values[k])
        if layout is not None:
            found[keys[k]] = layout
        elif k in delimiting:
            raise ValueError(
                f"split_inputs says argument {keys[k]!r} delimits documents, but it is "
                f"{_describe(values[k])}; give position ids restarting at 0 for each document "
                "(1 x T integers) or offsets [0, ..., T] (cu_seqlens), or another rule"
            )
    if not found or chunks < 2:
        return None
    lengths = _agreed(found, [keys[k] for k in delimiting])
    roles = {key: role for key, (role, _) in found.items()}
    for k in declared:  # an int is read as the longest length only when said to be one
        if _is_int(values[k]):
            roles[keys[k]] = "longest"
    if not _one_row(values, lengths, roles, keys):
        return None
    return DocumentCut(lengths, roles)


def _agreed(
    found: dict[str | int, tuple[str, tuple[int, ...]]], declared: list[str | int]
) -> tuple[int, ...]:
    """The documents every argument that delimits them agrees on (a declared one first)."""
    (first, (_, lengths)), *rest = found.items()
    for key, (_, other) in rest:
        if other != lengths:
            fix = (
                f"give {key!r} a rule of its own ('whole' or fn(value, pieces))"
                if declared
                else f"say which one to cut by: split_inputs={{{first!r}: pipepar.Documents()}}"
            )
            raise ValueError(
                f"arguments {first!r} and {key!r} delimit different documents (lengths "
                f"{list(lengths)} and {list(other)}); pass them for the same documents, or {fix}"
            )
    return lengths


def _one_row(
    values: Sequence[Any],
    lengths: tuple[int, ...],
    roles: dict[str | int, str],
    keys: Sequence[Any],
) -> bool:
    """Whether the batch is one row of the documents' tokens (several rows cut by rows)."""
    tokens = sum(lengths)
    rest = [v for key, v in zip(keys, values) if key not in roles and isinstance(v, Tensor)]
    rows = [t for t in rest if t.dim() > 0]
    if "positions" not in roles.values() and not any(_per_token(t, tokens) for t in rows):
        return False
    return all(t.shape[0] == 1 for t in rows[:1])


def _per_token(value: Any, tokens: int) -> bool:
    return (
        isinstance(value, Tensor)
        and value.dim() > SEQUENCE_DIM
        and value.shape[0] == 1
        and value.shape[SEQUENCE_DIM] == tokens
    )


def _is_int(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def balanced(lengths: Sequence[int], chunks: int) -> list[range]:
    """Runs of whole documents, one per micro-batch (``min(chunks, documents)`` of them), each
    ending at the document boundary nearest to its ideal end ``k * T / chunks`` (every run
    keeps at least one document).

    Example:
        >>> balanced([5, 1, 1, 5], 2)
        [range(0, 2), range(2, 4)]
    """
    n, m = len(lengths), max(1, min(chunks, len(lengths)))
    ends = [0, *torch.tensor(list(lengths)).cumsum(0).tolist()]
    total, cuts = ends[-1], [0]
    for k in range(1, m):
        low, high = cuts[-1] + 1, n - (m - k)  # each run before and after keeps a document
        ideal = k * total / m
        cuts.append(min(range(low, high + 1), key=lambda d: (abs(ends[d] - ideal), d)))
    cuts.append(n)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def split_value(
    key: str | int, value: Any, role: str | None, cut: DocumentCut, pieces: Sequence[range]
) -> tuple[list[Any], bool]:
    """An argument's value in each micro-batch of a document cut, and whether those values are
    the micro-batches' own parts (per-token tensors, offsets) rather than one value for all."""
    lengths = torch.tensor(cut.lengths)
    if role == "offsets":
        starts = [int(lengths[: p.start].sum()) for p in pieces]
        return [value[p.start : p.stop + 1] - s for p, s in zip(pieces, starts)], True
    if role == "longest":
        longest = [max(cut.lengths[p.start : p.stop]) for p in pieces]
        if isinstance(value, Tensor):
            return [torch.tensor(n, dtype=value.dtype, device=value.device) for n in longest], False
        return longest, False
    if _per_token(value, cut.tokens):
        return packed_pieces(
            value, Packed(lambda call: lengths, SEQUENCE_DIM), lengths, pieces, key
        ), True
    return [value] * len(pieces), False
