"""Where the batch is in each value of a call, and the operations that mix its rows.

Micro-batching is exact only for code that computes each row of the batch from that row alone
(and reduces the batch only in its loss). Some code does not: contrastive logits compare every
row with every other (``img @ txt.T``), batch norm in training normalises with statistics of
the batch, a mixture-of-experts router averages its statistics over all tokens, ``x -
x.mean(0)`` centres on the batch. Run per micro-batch, such code computes something else, with
nothing to say so.

:func:`batch_dim_after` follows the batch's dimension through one torch operation (a view, a
transpose, a matrix product, a reduction, indexing, broadcasting...) and returns the dimension
of the result that holds the rows, ``None`` where no rows are left to follow (a reduction to one
value, indices a router computed), or a :class:`Coupling` when the operation mixes rows: a
product contracting or pairing the batch, a reduction along it that keeps other dimensions, a
batch norm in training, a normalisation over it, picking a row by its position. An operation it
has no rule for and that is not element-wise (:mod:`pipepar.core.elementwise`) is a coupling
that is not ``certain``: refused by name, never guessed row-wise. The rules live by kind: views,
reductions and joins here; :mod:`~pipepar.core.batch_dim_families` (by what a dimension
argument means), :mod:`~pipepar.core.batch_layers`, :mod:`~pipepar.core.batch_products`,
:mod:`~pipepar.core.batch_indexing`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pipepar.core.batch_dim_families import ALL, FAMILIES, Rule, along, argument, named
from pipepar.core.batch_indexing import indexed, written
from pipepar.core.batch_layers import LAYERS, batch_first
from pipepar.core.batch_outcome import (
    Batched,
    Coupling,
    Outcome,
    aligned,
    dim_of,
    norm,
    unfollowed,
)
from pipepar.core.batch_products import PRODUCTS, linear
from pipepar.core.elementwise import elementwise

__all__ = ["COUPLING_CHOICES", "Coupling", "accepting", "batch_dim_after", "reduced_dims"]

COUPLING_CHOICES = ("error", "per-micro-batch")
"""What a pipe does with an operation mixing rows: refuse it, or let each micro-batch compute
it on its own rows."""


def batch_dim_after(
    name: str,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Tensor,
    batched: Sequence[Batched],
    loose: Sequence[Tensor] = (),
) -> Outcome:
    """The dimension of ``out`` that holds the batch after ``func`` (named ``name``) ran on
    ``args`` of which ``batched`` hold rows (one for each tensor of a result that holds them
    on different dimensions); None when it holds no rows to follow; a :class:`Coupling`,
    not ``certain`` for an operation whose effect on the rows is not known. ``loose``: values
    of the batch whose rows are not followed (a router's indices), trusted as indices."""
    if name == "getitem":
        return indexed(args[0], args[1], batched, loose)
    if name in ("setitem", "index_put"):
        return written(args[0], args[1], args[2], batched, loose)
    if name == "masked_scatter":
        return _masked_scatter(args, batched, loose)
    if name in _ROUTED and _routed(name, args, kwargs, batched, loose):
        return dim_of(args[0], batched) if name in _PUTS else None
    rule = _FUNCTIONAL.get(func) or _rule(name)
    if rule is None and name.endswith("_copy"):  # squeeze_copy: squeeze's result, copied
        rule = _rule(name[: -len("_copy")])
    if rule is not None:
        return rule(args, kwargs, out, batched)
    if elementwise(name.removesuffix("_copy"), func, args, kwargs):
        return aligned(out, batched, name)
    return unfollowed(name)


def _routed(
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batched: Sequence[Batched],
    loose: Sequence[Tensor],
) -> bool:
    """Whether ``x.index_add_(0, idx, ...)`` (and its kin) reaches rows of the batch at indices
    that are themselves values of the batch (a router's tokens): each micro-batch's own rows,
    trusted as indexing does (:mod:`pipepar.core.batch_indexing`)."""
    at = _ROUTED[name]
    index = args[at] if len(args) > at else kwargs.get("index", kwargs.get("indices"))
    of_batch = any(index is t for t in loose) or dim_of(index, batched) is not None
    d = dim_of(args[0], batched)
    dim = argument(args, kwargs, 1 if at == 2 else 2, ("dim",), None)
    return of_batch and (d is None or (isinstance(dim, int) and norm(dim, args[0].dim()) == d))


_PUTS = {"index_add", "index_copy", "index_fill", "index_reduce", "scatter", "scatter_add"}
_PUTS |= {"scatter_reduce"}
_ROUTED = {**dict.fromkeys(_PUTS | {"index_select", "gather"}, 2), "take_along_dim": 1}
"""Operations at indices, by the position of their index among the arguments."""


def _rule(name: str) -> Rule | None:
    return _RULES.get(name) or FAMILIES.get(name) or LAYERS.get(name)


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
            return e if merged or leading else unfollowed("view", _MOVED)
    return unfollowed("view", _MOVED)


_MOVED = "its result holds the rows' elements apart or in another order"


def _transposed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    if len(args) < 3:  # .t(): a matrix
        return 1 - d if t.dim() == 2 else d
    a, b = (norm(args[1], t.dim()), norm(args[2], t.dim()))
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
    return [norm(k, t.dim()) for k in order].index(d)


def _unsqueezed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    d = batched[0][1]
    k = norm(args[1] if len(args) > 1 else kwargs["dim"], out.dim())
    return d + 1 if k <= d else d


def _squeezed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    if t.shape[d] == 1:
        return None  # one row: nothing to mix
    kept = [k for k in range(t.dim()) if not (t.shape[k] == 1 and out.dim() < t.dim())]
    return kept.index(d) if len(kept) == out.dim() else aligned(out, batched, "squeeze")


# -- reductions and normalisations along a dimension -------------------------------------------
def _along(what: str) -> Callable[..., Outcome]:
    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        t, d = batched[0]
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if t is not args[0] or isinstance(other, Tensor):  # max(x, y): element-wise
            return aligned(out, batched, what)
        dims = reduced_dims(args, kwargs, t.dim(), 2 if what == "norm" else 1)
        if dims is None or out.dim() == 0:
            return None  # over every element: the loss's business (forms)
        if d in dims and t.shape[d] > 1:
            return Coupling(what, _OVER_ROWS, reduces=True)
        keep = bool(kwargs.get("keepdim", False))
        return d if keep or out.dim() == t.dim() else d - sum(1 for k in dims if k < d)

    return rule


_OVER_ROWS = "it computes over the rows of the batch, along their dimension"


def reduced_dims(args: Any, kwargs: Any, n: int, at: int = 1) -> set[int] | None:
    """The dimensions a reduction's ``dim`` argument (positional ``at``) names, of a tensor of
    ``n``; None when it names none (every element)."""
    dim = kwargs.get("dim", args[at] if len(args) > at else None)
    if dim is None or isinstance(dim, (torch.dtype, bool, str, float)):
        return None
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    return {norm(k, n) for k in dims} if dims else None


def _batch_norm(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    training = kwargs.get("training", args[5] if len(args) > 5 else False)
    t, d = batched[0]
    if training and t is args[0] and d != 1 and t.shape[d] > 1:  # channels: each on its own
        return Coupling(
            "batch_norm", "in training it normalises each row with statistics of the batch"
        )
    return aligned(out, batched, "batch_norm")


def _normalized_shape(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    t, d = batched[0]
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    if t is args[0] and d >= t.dim() - len(shape):
        return Coupling("layer_norm", "it normalises over the rows of the batch")
    return d if t is args[0] else aligned(out, batched, "layer_norm")


# -- joining and indexing ----------------------------------------------------------------------
def _cat(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    dims = {d + out.dim() - t.dim() for t, d in batched}
    return dims.pop() if len(dims) == 1 else unfollowed("cat", "it joins rows from two places")


def _stack(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    k = norm(kwargs.get("dim", args[1] if len(args) > 1 else 0), out.dim())
    dims = {d + 1 if k <= d else d for _, d in batched}
    return dims.pop() if len(dims) == 1 else unfollowed("stack", "it joins rows from two places")


# -- helpers -----------------------------------------------------------------------------------
def _first_only(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """An operation that keeps its first operand's dimensions (dropout, activations...)."""
    t, d = batched[0]
    return d if t is args[0] and out.dim() == t.dim() else aligned(out, batched, "op")


def _first_dims(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``view_as_complex``/``view_as_real``: the last dimension taken in or made; the others
    stay."""
    t, d = batched[0]
    return (
        d
        if d < min(t.dim(), out.dim()) - (1 if out.dim() < t.dim() else 0)
        else unfollowed("view_as_complex", "the rows are the real and imaginary parts")
    )


def _masked_select(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """The selected elements in order, flat: the rows' elements one row after another when the
    rows lead (after broadcasting)."""
    n = max(args[0].dim(), args[1].dim())
    if all(d + n - t.dim() == 0 for t, d in batched):
        return 0
    return unfollowed("masked_select", "it flattens the rows' elements out of their order")


def _masked_scatter(args: Any, batched: Sequence[Batched], loose: Sequence[Tensor]) -> Outcome:
    """``x.masked_scatter(mask, source)``: the masked places take the source's elements in
    order, which each micro-batch takes from the start of its own part of the source: right for
    a source cut with the micro-batch (image features of its own patches: ``loose``), not for
    one whose elements are not the micro-batch's alone."""
    x, mask, source = args[0], args[1], args[2]
    if not any(source is t for t in loose):
        return Coupling("masked_scatter", "each micro-batch would take the source from its start")
    n = max(x.dim(), mask.dim())
    if all(d + n - t.dim() == 0 for t, d in batched):
        return 0
    return unfollowed("masked_scatter", "its rows are not the mask's first dimension")


_REDUCTIONS = (
    "sum", "mean", "amax", "amin", "max", "min", "logsumexp", "var", "std", "prod", "argmax",
    "argmin", "norm", "median", "nansum", "nanmean", "var_mean", "std_mean", "any", "all",
    "count_nonzero", "nanmedian", "aminmax",
)  # fmt: skip
_RULES: dict[str, Rule] = {
    **dict.fromkeys(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"), _viewed),
    "ravel": _viewed,
    **dict.fromkeys(("transpose", "swapaxes", "swapdims", "t"), _transposed),
    **dict.fromkeys(("permute",), _permuted),
    **dict.fromkeys(("T", "H"), _dims_reversed),
    **dict.fromkeys(("mT", "mH", "adjoint"), _last_two_swapped),
    "unsqueeze": _unsqueezed,
    "squeeze": _squeezed,
    **PRODUCTS,
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "stack": _stack,
    **dict.fromkeys(("view_as_complex", "view_as_real"), _first_dims),
    "masked_select": _masked_select,
    "one_hot": lambda args, kwargs, out, batched: batched[0][1],  # a new last dimension
    **{name: _along(name) for name in _REDUCTIONS},
    **named(along(1, ALL), "cumsum", "cumprod", "softmax", "log_softmax"),
    **named(along(1, -1, ("dim",)), "sort"),
    **named(along(2, -1, ("dim",)), "topk"),
}
_FUNCTIONAL: dict[Callable[..., Any], Rule] = {
    F.linear: linear,
    F.batch_norm: _batch_norm,
    F.layer_norm: _normalized_shape,
    F.rms_norm: _normalized_shape,
    F.dropout: _first_only,
    F.unfold: batch_first("unfold", 4),
    F.fold: batch_first("fold", 3),
    F.embedding: lambda args, kwargs, out, batched: (
        batched[0][1] if batched[0][0] is args[0] else None
    ),
}
