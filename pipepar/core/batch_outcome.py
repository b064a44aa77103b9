"""What one operation does to the rows of the batch: the words the rules of
:mod:`pipepar.core.batch_dims` answer in, and the one default they share (broadcasting).

An operation either keeps the rows on one dimension of its result (an ``int``), mixes them (a
:class:`Coupling`), or takes values of the batch in a way that keeps no rows to follow (None:
a reduction to one number, a count of the batch used for routing). An operation whose effect on
the rows cannot be told is a :class:`Coupling` too, one that is not ``certain``: guessing it
row-wise would let wrong numbers through without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = [
    "Batched", "Coupling", "Outcome", "aligned", "dim_of", "norm", "resized", "unfollowed",
]  # fmt: skip

Batched = tuple[Tensor, int]
"""An operand holding rows of the batch and the dimension they are on."""


@dataclass(frozen=True)
class Coupling:
    """An operation that mixes rows of the batch (or may: ``certain=False``), and why."""

    op: str
    why: str
    certain: bool = True
    reduces: bool = False
    """A reduction over the rows (a sum, a count, ``any``): on integers, a count of the batch
    that routing may use, until it reaches floating-point values."""


Outcome = int | None | Coupling | tuple[int | None, ...]
"""Where the rows are in the result (one dimension for every tensor of it, or one for each,
in order), None where no rows are followed, or a :class:`Coupling`."""


def unfollowed(name: str, how: str = "") -> Coupling:
    """An operation whose effect on the rows pipepar cannot tell: refused, never guessed."""
    because = f"{how}; " if how else ""
    return Coupling(
        name, f"{because}pipepar cannot follow the rows of the batch through it", certain=False
    )


def aligned(out: Tensor, batched: Sequence[Batched], name: str) -> Outcome:
    """Element-wise with broadcasting: each operand's batch dimension, aligned from the right,
    must land on one dimension of the result; two different ones pair rows."""
    dims = set()
    for t, d in batched:
        e = d + out.dim() - t.dim()
        if not 0 <= e < out.dim() or out.shape[e] != t.shape[d]:
            return unfollowed(name, f"its result of shape {tuple(out.shape)} drops the rows")
        dims.add(e)
    if len(dims) > 1 and all(out.shape[e] > 1 for e in dims):
        return Coupling(name, "it pairs every row of the batch with every other")
    return dims.pop() if len(dims) == 1 else None


def dim_of(t: Any, batched: Sequence[Batched]) -> int | None:
    """Where ``t`` holds the rows, if it is one of the operands holding them."""
    return next((d for b, d in batched if b is t), None)


def norm(k: int, n: int) -> int:
    """Dimension ``k`` (maybe negative) of a tensor of ``n`` dimensions, from the front."""
    return k + n if k < 0 else k


def resized(coupling: Coupling, out: Tensor, batched: Sequence[Batched]) -> tuple[int, int] | None:
    """The rows an operand had and the rows its result holds where ``coupling`` repeats or
    drops rows (``x.repeat(2, 1)``, ``x[1:]``, ``F.pad`` over the rows): a result keeping an
    operand's dimensions with another number of rows. None for any other coupling, a reduction
    over the rows included (``x.mean(0, keepdim=True)``: its count matters, not its shape)."""
    if coupling.reduces:
        return None
    for t, d in batched:
        if out.dim() == t.dim() and out.shape[d] != t.shape[d]:
            return t.shape[d], out.shape[d]
    return None
