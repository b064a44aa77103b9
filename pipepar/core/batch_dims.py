"""Where the batch is in each value of a call, and the operations that mix its rows.

Micro-batching is exact only for code that computes each row of the batch from that row alone
(and reduces the batch only in its loss). Some code does not: contrastive logits compare every
row with every other (``img @ txt.T``), batch norm in training normalises with statistics of
the batch, a mixture-of-experts router averages its statistics over all tokens, ``x -
x.mean(0)`` centres on the batch. Run per micro-batch, such code computes something else, with
nothing to say so.

:func:`batch_dim_after` follows the batch's dimension through one torch operation (a view, a
transpose, a matrix product, a reduction, indexing, broadcasting...) and returns the dimension
of the result that holds the rows, ``None`` when it cannot tell (it then stops following that
value, never guessing), or a :class:`Coupling` when the operation mixes rows: a product
contracting or pairing the batch, a reduction along it that keeps other dimensions, a batch
norm in training, a normalisation over it, picking a row by its position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["COUPLING_CHOICES", "Coupling", "accepting", "batch_dim_after", "reduced_dims"]

COUPLING_CHOICES = ("error", "per-micro-batch")
"""What a pipe does with an operation mixing rows: refuse it, or let each micro-batch compute
it on its own rows."""

Batched = tuple[Tensor, int]
"""An operand holding rows of the batch and the dimension they are on."""


@dataclass(frozen=True)
class Coupling:
    """An operation that mixes rows of the batch: what it is and why."""

    op: str
    why: str


Outcome = int | None | Coupling


def batch_dim_after(
    name: str,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Tensor,
    batched: Sequence[Batched],
) -> Outcome:
    """The dimension of ``out`` that holds the batch after ``func`` (named ``name``) ran on
    ``args`` of which ``batched`` hold rows; None when unknown; a :class:`Coupling`."""
    rule = _RULES.get(name)
    if rule is not None:
        return rule(args, kwargs, out, batched)
    if func in _FUNCTIONAL:
        return _FUNCTIONAL[func](args, kwargs, out, batched)
    return _aligned(out, batched, name)


def accepting(batch_coupling: str, deferred_batch_norm: bool) -> Callable[[Coupling], bool]:
    """Which couplings a pipe accepts: all with ``batch_coupling="per-micro-batch"``, batch
    norm's with ``deferred_batch_norm`` (micro-batch statistics asked for), none otherwise.

    Raises:
        ValueError: ``batch_coupling`` is not one of :data:`COUPLING_CHOICES`.
    """
    if batch_coupling not in COUPLING_CHOICES:
        raise ValueError(
            f"batch_coupling must be one of {COUPLING_CHOICES}, but got {batch_coupling!r}; "
            "'error' stops at an operation that mixes rows of the batch, 'per-micro-batch' lets "
            "each micro-batch compute it on its own rows"
        )
    if batch_coupling == "per-micro-batch":
        return lambda coupling: True
    return lambda coupling: deferred_batch_norm and coupling.op == "batch_norm"


# -- broadcasting, the default -----------------------------------------------------------------
def _aligned(out: Tensor, batched: Sequence[Batched], name: str) -> Outcome:
    """Element-wise with broadcasting: each operand's batch dimension, aligned from the right,
    must land on one dimension of the result; two different ones pair rows."""
    dims = set()
    for t, d in batched:
        e = d + out.dim() - t.dim()
        if not 0 <= e < out.dim() or out.shape[e] != t.shape[d]:
            return None
        dims.add(e)
    if len(dims) > 1 and all(out.shape[e] > 1 for e in dims):
        return Coupling(name, "it pairs every row of the batch with every other")
    return dims.pop() if len(dims) == 1 else None


# -- views -------------------------------------------------------------------------------------
def _viewed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """A view or reshape: the dimension starting where the batch started (the same elements
    before it), holding the rows (whole, or as its leading factor)."""
    t, d = batched[0]
    before = math.prod(t.shape[:d])
    size = t.shape[d]
    for e in range(out.dim()):
        if math.prod(out.shape[:e]) == before:
            n = out.shape[e]
            merged = n % size == 0 and n >= size  # the rows and what followed them
            leading = size % n == 0 and n > 1  # the rows' leading factor (rows x tokens split)
            return e if merged or leading else None
    return None


def _transposed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    if len(args) < 3:  # .t(): a matrix
        return 1 - d if t.dim() == 2 else d
    a, b = (_norm(args[1], t.dim()), _norm(args[2], t.dim()))
    return b if d == a else a if d == b else d


def _dims_reversed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``x.T`` and ``x.H``: every dimension in reverse order."""
    t, d = batched[0]
    return t.dim() - 1 - d


def _last_two_swapped(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``x.mT`` and ``x.mH``: the last two dimensions swapped."""
    t, d = batched[0]
    n = t.dim()
    return n - 1 if d == n - 2 else n - 2 if d == n - 1 else d


def _permuted(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    order = kwargs.get("dims", order)
    return [_norm(k, t.dim()) for k in order].index(d)


def _unsqueezed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    d = batched[0][1]
    k = _norm(args[1] if len(args) > 1 else kwargs["dim"], out.dim())
    return d + 1 if k <= d else d


def _squeezed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    if t.shape[d] == 1:
        return None
    kept = [k for k in range(t.dim()) if not (t.shape[k] == 1 and out.dim() < t.dim())]
    return kept.index(d) if len(kept) == out.dim() else _aligned(out, batched, "squeeze")


# -- matrix products ---------------------------------------------------------------------------
def _matmul(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    a, b = args[0], args[1]
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() < 2 or b.dim() < 2:
        return None
    da, db = _dim_of(a, batched), _dim_of(b, batched)
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
    return _aligned(out, leading, "matmul")  # type: ignore[arg-type]


def _linear(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    x = args[0]
    d = _dim_of(x, batched)
    if d is None:
        return None  # rows in the weight: not a layer's use
    if d == x.dim() - 1:
        return Coupling("linear", "it sums products over the rows of the batch")
    return d


def _einsum(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    equation = args[0].replace(" ", "")
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    letters = set()
    for spec, t in zip(inputs.split(","), operands):
        d = _dim_of(t, batched)
        if d is not None:
            letters.add(spec[d])
    if any(letter not in output for letter in letters):
        return Coupling("einsum", "it sums products over the rows of the batch")
    if len(letters) > 1:
        return Coupling("einsum", "it pairs every row of the batch with every other")
    return output.index(letters.pop()) if letters else None


# -- reductions and normalisations along a dimension -------------------------------------------
def _along(what: str) -> Callable[..., Outcome]:
    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        t, d = batched[0]
        if t is not args[0]:
            return _aligned(out, batched, what)
        dims = reduced_dims(args, kwargs, t.dim())
        if dims is None or out.dim() == 0:
            return None  # over every element: the loss's business (forms)
        if d in dims and t.shape[d] > 1:
            return Coupling(what, "it computes over the rows of the batch, along their dimension")
        keep = bool(kwargs.get("keepdim", False))
        return d if keep or out.dim() == t.dim() else d - sum(1 for k in dims if k < d)

    return rule


def reduced_dims(args: Any, kwargs: Any, n: int) -> set[int] | None:
    """The dimensions a reduction's ``dim`` argument names, of a tensor of ``n``; None when
    it names none (every element)."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None or isinstance(dim, torch.dtype):
        return None
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    return {_norm(k, n) for k in dims} if dims else None


def _batch_norm(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    training = kwargs.get("training", args[5] if len(args) > 5 else False)
    t, d = batched[0]
    if training and t is args[0] and d == 0 and t.shape[0] > 1:
        return Coupling(
            "batch_norm", "in training it normalises each row with statistics of the batch"
        )
    return _aligned(out, batched, "batch_norm")


def _normalized_shape(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    if t is args[0] and d >= t.dim() - len(shape):
        return Coupling("layer_norm", "it normalises over the rows of the batch")
    return d if t is args[0] else _aligned(out, batched, "layer_norm")


# -- joining and indexing ----------------------------------------------------------------------
def _cat(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    dims = {d + out.dim() - t.dim() for t, d in batched}
    return dims.pop() if len(dims) == 1 else None


def _stack(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    k = _norm(kwargs.get("dim", args[1] if len(args) > 1 else 0), out.dim())
    dims = {d + 1 if k <= d else d for _, d in batched}
    return dims.pop() if len(dims) == 1 else None


def _getitem(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    if t is not args[0]:
        return None  # rows used as an index
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if d == 0 and index and _row_by_row(index[0], t.shape[0]) and out.shape[:1] == t.shape[:1]:
        return 0  # x[torch.arange(len(x)), idx]: one element of each row, in order
    if any(isinstance(i, (Tensor, list)) for i in index) or index.count(Ellipsis) > 1:
        return None
    return _basic_index(t, d, index)


def _row_by_row(index: Any, rows: int) -> bool:
    """Whether ``index`` takes the rows in their order: ``torch.arange(rows)``."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.shape[0] != rows:
        return False
    if index.device.type == "meta" or index.is_floating_point() or index.dtype == torch.bool:
        return False
    return bool(torch.equal(index.cpu(), torch.arange(rows)))


def _basic_index(t: Tensor, d: int, index: tuple[Any, ...]) -> Outcome:
    if Ellipsis in index:
        k = index.index(Ellipsis)
        taken = sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:k] + (slice(None),) * (t.dim() - taken) + index[k + 1 :]
    dim_in, dim_out = 0, 0
    for i in index:
        if i is None:
            dim_out += 1
            continue
        if dim_in == d:
            if isinstance(i, int):
                return Coupling("getitem", "it picks a row of the batch by its position")
            return dim_out if i == slice(None) else None
        dim_in += 1
        dim_out += 0 if isinstance(i, int) else 1
    return dim_out + (d - dim_in)


# -- helpers -----------------------------------------------------------------------------------
def _dim_of(t: Any, batched: Sequence[Batched]) -> int | None:
    return next((d for b, d in batched if b is t), None)


def _norm(k: int, n: int) -> int:
    return k + n if k < 0 else k


def _first_only(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """An operation that keeps its first operand's dimensions (dropout, activations...)."""
    t, d = batched[0]
    return d if t is args[0] and out.dim() == t.dim() else _aligned(out, batched, "op")


_Rule = Callable[[Any, Any, Tensor, Sequence[Batched]], Outcome]
_RULES: dict[str, _Rule] = {
    **dict.fromkeys(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"), _viewed),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims", "t"), _transposed),
    **dict.fromkeys(("permute",), _permuted),
    **dict.fromkeys(("T", "H"), _dims_reversed),
    **dict.fromkeys(("mT", "mH"), _last_two_swapped),
    "unsqueeze": _unsqueezed,
    "squeeze": _squeezed,
    **dict.fromkeys(("matmul", "mm", "bmm", "rmatmul"), _matmul),
    "einsum": _einsum,
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "stack": _stack,
    "getitem": _getitem,
    "one_hot": lambda args, kwargs, out, batched: batched[0][1],  # a new last dimension
    **{
        name: _along(name)
        for name in (
            "sum", "mean", "amax", "amin", "max", "min", "logsumexp", "var", "std", "prod",
            "argmax", "argmin", "norm", "cumsum", "cumprod", "softmax", "log_softmax", "sort",
            "topk", "median", "nansum", "nanmean", "var_mean", "std_mean", "any", "all",
            "count_nonzero",
        )
    },
}
_FUNCTIONAL: dict[Callable[..., Any], _Rule] = {
    F.linear: _linear,
    F.batch_norm: _batch_norm,
    F.layer_norm: _normalized_shape,
    F.softmax: _along("softmax"),
    F.log_softmax: _along("log_softmax"),
    F.normalize: lambda args, kwargs, out, batched: _along("normalize")(
        (args[0], kwargs.get("dim", args[2] if len(args) > 2 else 1)), {}, out, batched
    ),
    F.dropout: _first_only,
    F.embedding: lambda args, kwargs, out, batched: batched[0][1]
    if batched[0][0] is args[0]
    else None,
}
