"""Products of tensors: what contracting dimensions (summing products over them) and pairing
them (every index of one operand with every index of the other) does to the rows of the batch.

A product keeps the rows when they are on a dimension that only one operand has and that the
result keeps (``x @ W``: the rows of ``x``; ``W @ x.T``: the columns); it mixes them when it
sums over them (``x.T @ x``) or pairs them with themselves (``x @ x.T``, ``cdist(x, x)``,
``outer(a, a)``). Matrix products, their ``add`` forms, vectors, ``tensordot``, ``inner``,
``outer``, ``cdist`` and ``einsum`` (``...`` and implicit outputs spelled out) are read so.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from pipepar.core.batch_dim_families import Rule
from pipepar.core.batch_outcome import Batched, Coupling, Outcome, aligned, dim_of, norm, unfollowed

__all__ = ["PRODUCTS", "linear"]


def _matmul(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    a, b = args[0], args[1]
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return unfollowed("matmul")
    if a.dim() < 2 or b.dim() < 2:
        return _with_vector(a, b, out, batched)
    da, db = dim_of(a, batched), dim_of(b, batched)
    rows_a = da is not None and da == a.dim() - 2
    cols_b = db is not None and db == b.dim() - 1
    if (da is not None and da == a.dim() - 1) or (db is not None and db == b.dim() - 2):
        return Coupling("matmul", "it sums products over the rows of the batch")
    if rows_a and cols_b and out.shape[-1] > 1 and out.shape[-2] > 1:
        return Coupling("matmul", "it pairs every row of the batch with every other")
    if rows_a:
        return out.dim() - 2
    if cols_b:
        return out.dim() - 1
    leading = [t for t in ((a, da), (b, db)) if t[1] is not None]
    return aligned(out, leading, "matmul")  # type: ignore[arg-type]


def _with_vector(a: Tensor, b: Tensor, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """A product with a vector: as with a one-column (or one-row) matrix, dropped after."""
    vec_a, vec_b = a.unsqueeze(-2) if a.dim() == 1 else a, b.unsqueeze(-1) if b.dim() == 1 else b
    as_matrices = [(vec_a if t is a else vec_b, d) for t, d in batched]
    wide = out.unsqueeze(-2) if a.dim() == 1 else out
    wide = wide.unsqueeze(-1) if b.dim() == 1 else wide
    outcome = _matmul((vec_a, vec_b), {}, wide, as_matrices)
    if not isinstance(outcome, int):
        return outcome
    dropped = [
        k for k, flag in ((wide.dim() - 2, a.dim() == 1), (wide.dim() - 1, b.dim() == 1)) if flag
    ]
    return outcome - sum(1 for k in dropped if k < outcome) if outcome not in dropped else None


def linear(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    x = args[0]
    d = dim_of(x, batched)
    if d is None:
        return unfollowed("linear", "the rows are in its weight")
    if d == x.dim() - 1:
        return Coupling("linear", "it sums products over the rows of the batch")
    return d


def _einsum(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    inputs, output = _spelled_out(args[0], operands)
    letters = set()
    for spec, t in zip(inputs.split(","), operands):
        d = dim_of(t, batched)
        if d is not None:
            letters.add(spec[d])
    if any(letter not in output for letter in letters):
        return Coupling("einsum", "it sums products over the rows of the batch")
    if len(letters) > 1:
        return Coupling("einsum", "it pairs every row of the batch with every other")
    return output.index(letters.pop()) if letters else None


def _spelled_out(equation: str, operands: Sequence[Tensor]) -> tuple[str, str]:
    """An einsum equation's inputs and output, ``...`` spelled out as letters it leaves
    unused, and the output it implies when it gives none."""
    equation = equation.replace(" ", "")
    spare = [c for c in string.ascii_letters if c not in equation]
    inputs, arrow, output = equation.partition("->")
    specs = inputs.split(",")
    widest = 0
    for k, (spec, t) in enumerate(zip(specs, operands)):
        if "..." in spec:
            n = t.dim() - (len(spec) - 3)
            widest = max(widest, n)
            specs[k] = spec.replace("...", "".join(spare[-n:] if n else []))
    ellipsis = "".join(spare[-widest:] if widest else [])
    if not arrow:
        once = sorted(c for c in set("".join(specs)) if "".join(specs).count(c) == 1)
        output = ellipsis + "".join(c for c in once if c not in ellipsis)
    return ",".join(specs), output.replace("...", ellipsis)


def _rmatmul(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    return _matmul((args[1], args[0]), kwargs, out, batched)


def _addmm(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``addmm(bias, a, b)`` and its kin: the product's rows, then the bias broadcast."""
    product = _matmul(args[1:3], {}, out, [b for b in batched if b[0] is not args[0]])
    bias = [b for b in batched if b[0] is args[0]]
    if isinstance(product, Coupling) or not bias:
        return product
    return aligned(out, bias + ([(out, product)] if isinstance(product, int) else []), "addmm")


def _over_batches(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``addbmm``: a sum of products over the first dimension of both operands."""
    if any(d == 0 for t, d in batched if t is not args[0]):
        return Coupling("addbmm", "it sums products over the rows of the batch")
    return _addmm((args[0], args[1][0], args[2][0]), kwargs, out, batched)


def _products(what: str, contract: Callable[[Any, Any], tuple[list[int], list[int]]]) -> Rule:
    """Products that contract the dimensions ``contract(args, kwargs)`` names (of ``a``, of
    ``b``) and keep the others, ``a``'s first: tensordot, inner, outer."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        a, b = args[0], args[1]
        pairs = zip((a, b), contract(args, kwargs))
        on_a, on_b = ({norm(k, t.dim()) for k in c} for t, c in pairs)
        da, db = dim_of(a, batched), dim_of(b, batched)
        if (da is not None and da in on_a) or (db is not None and db in on_b):
            return Coupling(what, "it sums products over the rows of the batch")
        if da is not None and db is not None:
            return Coupling(what, "it pairs every row of the batch with every other")
        kept_a = [k for k in range(a.dim()) if k not in on_a]
        if da is not None:
            return kept_a.index(da)
        if db is None:
            return None
        return len(kept_a) + [k for k in range(b.dim()) if k not in on_b].index(db)

    return rule


def _tensordot_dims(args: Any, kwargs: Any) -> tuple[list[int], list[int]]:
    a, dims = args[0], kwargs.get("dims", args[2] if len(args) > 2 else 2)
    if isinstance(dims, int):
        return list(range(a.dim() - dims, a.dim())), list(range(dims))
    return [_listed(v) for v in dims]  # type: ignore[return-value]


def _listed(value: Any) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


def _cdist(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``cdist(x1, x2)``: every row of ``x1`` with every row of ``x2``, over the features:
    ``x1 @ x2.mT``'s rows (``x1`` and ``x2`` may be one tensor)."""
    a, b = args[0], args[1]
    bt, n = b.mT, b.dim()
    da, db = dim_of(a, batched), dim_of(b, batched)
    swapped = [(a, da)] if da is not None else []
    if db is not None:
        swapped.append((bt, n - 1 if db == n - 2 else n - 2 if db == n - 1 else db))
    outcome = _matmul((a, bt), {}, out, swapped)
    return Coupling("cdist", outcome.why) if isinstance(outcome, Coupling) else outcome


PRODUCTS: dict[str, Rule] = {
    **dict.fromkeys(("matmul", "linalg_matmul", "mm", "bmm", "mv", "dot", "vdot"), _matmul),
    "rmatmul": _rmatmul,
    **dict.fromkeys(["addmm", "baddbmm", "addmv"], _addmm),
    "addbmm": _over_batches,
    "tensordot": _products("tensordot", _tensordot_dims),
    "inner": _products("inner", lambda args, kwargs: ([-1], [-1])),
    **dict.fromkeys(("outer", "ger"), _products("outer", lambda args, kwargs: ([], []))),
    "cdist": _cdist,
    "einsum": _einsum,
}
"""The products' rules, by the operation's name."""
