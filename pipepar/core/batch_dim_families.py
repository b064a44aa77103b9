"""Families of torch operations, by how they treat the dimensions of their operands: what each
does to the rows of the batch.

Most torch operations that are not element-wise fall in a few families, told apart by what
their dimension arguments mean, not by the operation's name:

* *along* some dimensions (scans, sorts, flips, rolls, differences, Fourier transforms,
  normalisations, reductions): rows on one of them are mixed, rows elsewhere stay;
* *spatial* (pooling, resizing): the last 1, 2 or 3 dimensions are mixed, each channel on its own;
* *positions* along a dimension (index_select, gather, scatter, narrow, split): rows there are
  taken by their position, which a micro-batch does not share with the batch;
* *copies* (repeat, tile): the batch repeated after itself is not each micro-batch repeated;
* *every element* (pdist, cov, kron, unique without a dim, histc): all rows are mixed.

A family's rule gets the operation's positional and keyword arguments and the operands holding
rows, and answers an :data:`~pipepar.core.batch_outcome.Outcome`. Layers whose dimensions
have roles (batch-first, matrices, attention, recurrence) are in
:mod:`pipepar.core.batch_layers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from pipepar.core.batch_outcome import Batched, Coupling, Outcome, aligned, norm, unfollowed

__all__ = ["ALL", "FAMILIES", "Rule", "along", "argument", "broadcast_dims", "named"]

Rule = Callable[[Any, Any, Tensor, Sequence[Batched]], Outcome]
ALL = "all"
"""The default of a dimension argument that, left out, means every dimension."""
SPATIAL = "spatial"
"""The default of an operation on images or sequences: every dimension after (batch, channels)."""


def argument(args: Any, kwargs: Any, at: int, keys: Sequence[str], default: Any) -> Any:
    """Argument ``at`` (or one of the keywords ``keys``), ``default`` when not given."""
    for key in keys:
        if key in kwargs:
            return kwargs[key]
    return args[at] if len(args) > at else default


def _dims(value: Any, n: int) -> set[int]:
    """The dimensions a dimension argument names, of a tensor of ``n``: ALL or None is all,
    SPATIAL all but the first two (batch, channels)."""
    if value is None or value == ALL:
        return set(range(n))
    if value == SPATIAL:
        return set(range(2, n))
    values = value if isinstance(value, (tuple, list)) else [value]
    return {norm(int(k), n) for k in values}


def broadcast_dims(batched: Sequence[Batched]) -> tuple[int, list[int]]:
    """The dimensions of the operands broadcast together, and each one's rows there."""
    n = max(t.dim() for t, _ in batched)
    return n, [d + n - t.dim() for t, d in batched]


# -- along some dimensions ---------------------------------------------------------------------
def along(
    at: int,
    default: Any,
    keys: Sequence[str] = ("dim", "dims"),
    keeps: bool = False,
    reduces: bool = False,
) -> Rule:
    """Computes along the dimension(s) its argument ``at`` (or keyword ``keys``) names,
    ``default`` when left out; ``keeps``: the argument names the one dimension left alone.
    ``x.flip(0, 1)``: the dimensions as several arguments."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        name = "along"
        n, rows = broadcast_dims(batched)
        value = argument(args, kwargs, at, keys, default)
        if len(args) > at + 1 and all(type(a) is int for a in args[at:]):
            value = args[at:]
        if isinstance(value, bool) or not isinstance(value, (int, tuple, list, str, type(None))):
            value = default  # var(x, True): an option where the dimension may be
        named = _dims(value, n)
        dims = set(range(n)) - named if keeps else named
        mixed = [e for (t, d), e in zip(batched, rows) if e in dims and t.shape[d] > 1]
        if mixed:
            return Coupling(
                name,
                "it computes over the rows of the batch, along their dimension",
                reduces=reduces,
            )
        if len(set(rows)) > 1:
            return aligned(out, batched, name)
        e = rows[0]
        if out.dim() == n or bool(kwargs.get("keepdim")):
            return e if out.dim() > e else unfollowed(name)
        return e - sum(1 for k in dims if k < e) if out.dim() == n - len(dims) else unfollowed(name)

    return rule


def named(rule: Rule, *names: str) -> dict[str, Rule]:
    """``rule`` for each of ``names``, its couplings named after the operation."""

    def renamed(name: str) -> Rule:
        def each(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
            outcome = rule(args, kwargs, out, batched)
            if isinstance(outcome, Coupling):
                return dataclasses.replace(outcome, op=name)
            return outcome

        return each

    return {name: renamed(name) for name in names}


def rot90(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """Flips one of two dimensions and swaps them (``k`` times): rows flipped are mixed."""
    t, d = batched[0]
    k = argument(args, kwargs, 1, ("k",), 1) % 4
    a, b = (norm(x, t.dim()) for x in argument(args, kwargs, 2, ("dims",), (0, 1)))
    if d not in (a, b) or k == 0:
        return d
    flipped = k == 2 or (k == 1 and d == b) or (k == 3 and d == a)
    if flipped:
        return Coupling("rot90", "it reverses the order of the rows of the batch")
    return b if d == a else a


def diagonal(first: int, second: int) -> Rule:
    """The diagonal of two dimensions (``dim1``, ``dim2``, by default ``first`` and
    ``second``), as a new last one."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        t, d = batched[0]
        pair = {norm(argument(args, kwargs, 2, ("dim1",), first), t.dim())}
        pair.add(norm(argument(args, kwargs, 3, ("dim2",), second), t.dim()))
        if d in pair:
            return Coupling("diagonal", "it takes the rows of the batch by their position")
        return d - sum(1 for k in pair if k < d)

    return rule


def diag_embed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """Each vector along the last dimension made the diagonal of a matrix on two new last
    dimensions (by default): rows on the last dimension are placed by their position."""
    t, d = batched[0]
    last_two = argument(args, kwargs, 2, ("dim1",), -2) in (-2, out.dim() - 2) and argument(
        args, kwargs, 3, ("dim2",), -1
    ) in (-1, out.dim() - 1)
    if d == t.dim() - 1:
        return Coupling("diag_embed", "it places the rows of the batch by their position")
    return d if last_two else unfollowed("diag_embed")


def spatial(what: str) -> Rule:
    """Pooling and resizing: over the last 1, 2 or 3 dimensions (the ``1d``/``2d``/``3d`` in
    the name; every one after (batch, channels) without it), each channel on its own."""
    k = int(what[-2]) if what[-2:] in ("1d", "2d", "3d") else None
    rule = along(99, SPATIAL if k is None else tuple(range(-k, 0)), ())
    return named(rule, what)[what]


def fftn(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``fftn(x, s, dim)``: over ``dim``; without it, the last ``len(s)`` dimensions, or all."""
    sizes = argument(args, kwargs, 1, ("s",), None)
    dims = argument(args, kwargs, 2, ("dim",), None)
    if dims is None and sizes is not None:
        count = len(sizes) if isinstance(sizes, (tuple, list)) else 1
        dims = tuple(range(-count, 0))
    return along(99, ALL if dims is None else dims, ())(args, kwargs, out, batched)


# -- positions along a dimension ---------------------------------------------------------------
def positions(at: int, what: str, puts: bool = False) -> Rule:
    """Takes (or ``puts``) positions along the dimension its argument ``at`` names: rows
    there are taken (or written) by their position, unless they are the index's own rows
    taking from a constant (``index_select(table, 0, ids)``: a look-up)."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        x = args[0]
        dim = norm(argument(args, kwargs, at, ("dim",), 0), x.dim())
        for t, d in batched:
            if (t is x or puts) and d + x.dim() - t.dim() == dim and t.shape[d] > 1:
                return Coupling(what, "it takes or puts rows of the batch by their position")
        if what == "index_select" and not any(t is x for t, _ in batched):
            return dim  # the index's rows, one look-up each
        return aligned(out, batched, what)

    return rule


def parts(at: int, keys: Sequence[str] = ("dim",), default: int = 0) -> Rule:
    """Cuts along a dimension (split, chunk, unbind): parts of the rows are rows by position."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        t, d = batched[0]
        dim = norm(argument(args, kwargs, at, keys, default), t.dim())
        if d != dim:
            return d if out.dim() == t.dim() else d - (1 if dim < d else 0)
        if out.dim() == t.dim() and out.shape[d] == t.shape[d]:
            return d  # one part: the whole
        return unfollowed("split", "it cuts the rows of the batch into parts by position")

    return rule


# -- copies ------------------------------------------------------------------------------------
def copies(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``repeat``/``tile``: the batch after itself, unless its factor on the rows is 1."""
    t, d = batched[0]
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    sizes = list(kwargs.get("dims", sizes))
    e = d + out.dim() - t.dim()
    factors = [1] * (out.dim() - len(sizes)) + sizes
    if t is not args[0] or factors[e] != 1:
        return Coupling("repeat", "it repeats the whole batch after itself")
    return e


def interleaved(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``repeat_interleave``: each element repeated in place; rows stay in order."""
    t, d = batched[0]
    dim = argument(args, kwargs, 2, ("dim",), None)
    if t is not args[0]:
        return unfollowed("repeat_interleave", "the rows give the repeats")
    if dim is None:
        return 0 if d == 0 else Coupling("repeat_interleave", "it flattens the rows' elements")
    return d


def every_element(what: str) -> Rule:
    """Mixes every element of its operands (distances between all rows, a covariance...)."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        return Coupling(what, "it combines every row of the batch with every other")

    return rule


_SPATIAL = (
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d",
    "max_pool1d_with_indices", "max_pool2d_with_indices", "interpolate", "upsample",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d", "max_unpool1d",
    "max_unpool2d", "max_unpool3d",
)  # fmt: skip
_PUTS = (
    "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
    "index_reduce",
)  # fmt: skip
FAMILIES: dict[str, Rule] = {
    **named(along(1, None), "cummax", "cummin", "logcumsumexp", "flip"),
    **named(along(99, 0), "msort"),
    **named(along(1, -1), "argsort", "mode", "softmin", "glu"),
    **named(along(2, -1), "kthvalue", "diff", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft"),
    **named(along(2, -1), "fft_hfft", "fft_ihfft", "linalg_cross"),
    **named(along(2, 1), "cosine_similarity"),
    **named(along(2, (-2, -1)), "fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2"),
    **named(along(2, ALL), "roll"),
    **named(along(1, ALL), "fft_fftshift", "fft_ifftshift"),
    **named(along(99, ALL, reduces=True), "histc", "bincount"),
    **named(along(2, ALL, ("dim",)), "quantile", "nanquantile", "linalg_vector_norm"),
    **named(along(2, (-2, -1), ("dim",)), "linalg_matrix_norm"),
    **named(along(2, 1, ("dim",)), "normalize"),
    **named(along(99, 1, ()), "local_response_norm"),
    **named(along(2, 0, ("dim",), keeps=True), "renorm"),
    **named(along(99, 1), "fliplr"),
    **named(along(99, 0), "flipud"),
    **named(along(1, 0, ("dimension",)), "unfold"),
    **named(along(99, -1), "pairwise_distance"),
    **named(along(99, -1, ("dim",)), "linalg_vecdot"),
    "rot90": rot90,
    **named(along(2, ALL), "cross"),  # without a dimension: the first of size 3
    **named(along(99, (-2, -1)), "triu", "tril", "trace"),
    "diagonal": diagonal(0, 1),
    "linalg_diagonal": diagonal(-2, -1),
    "diag_embed": diag_embed,
    **dict.fromkeys(("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn"), fftn),
    **dict.fromkeys(("fft_hfftn", "fft_ihfftn"), fftn),
    **named(along(2, (-2, -1)), "fft_hfft2", "fft_ihfft2"),
    **named(along(99, -1, ("dim",)), "cumulative_trapezoid", "trapezoid", "trapz"),
    **named(along(1, ALL), "frobenius_norm", "special_logsumexp"),
    **named(along(1, ALL), "special_softmax", "special_log_softmax"),
    **named(along(2, 0, ("dim",), keeps=True), "norm_except_dim"),
    **{name: spatial(name) for name in _SPATIAL},
    **named(along(99, ALL), "diag", "take", "pdist", "cov", "corrcoef", "kron"),
    **named(every_element("unique"), "unique", "unique_dim", "unique_consecutive"),
    **{name: positions(1, name) for name in ("index_select", "gather", "narrow", "select")},
    **{name: positions(1, name, puts=True) for name in _PUTS},
    "take_along_dim": positions(2, "take_along_dim"),
    **named(parts(2), "split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split"),
    **named(parts(2), "unsafe_chunk", "unsafe_split_with_sizes"),
    **named(parts(99, (), 0), "vsplit"),
    **named(parts(99, (), 1), "hsplit"),
    **named(parts(99, (), 2), "dsplit"),
    **named(parts(1), "unbind"),
    **dict.fromkeys(("repeat", "tile"), copies),
    "repeat_interleave": interleaved,
}
"""The families' rules, by the operation's name."""
