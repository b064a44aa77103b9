"""Families of torch operations, by how they treat the dimensions of their operands: what each
does to the rows of the batch.

Most torch operations that are not element-wise fall in a few families, told apart by what
their dimension arguments mean, not by the operation's name:

* *along* some dimensions (scans, sorts, flips, rolls, differences, Fourier transforms,
  normalisations, reductions): rows on one of them are mixed, rows elsewhere stay;
* *batch-first* (convolutions, pooling, instance and group norm, im2col): the first dimension is
  a batch of independent samples, every other one is mixed;
* *matrices* on the last two dimensions (triangles, linear algebra, attention): rows on those
  are mixed, rows on the leading (batch) dimensions stay;
* *positions* along a dimension (index_select, gather, scatter, narrow, split): rows there are
  taken by their position, which a micro-batch does not share with the batch;
* *copies* (repeat, tile): the batch repeated after itself is not each micro-batch repeated;
* *every element* (pdist, cov, kron, unique without a dim, histc): all rows are mixed.

A family's rule gets the operation's positional and keyword arguments and the operands holding
rows, and answers an :data:`~pipepar.core.batch_outcome.Outcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from pipepar.core.batch_outcome import Batched, Coupling, Outcome, aligned, norm, unfollowed

__all__ = ["ALL", "FAMILIES", "Rule", "along", "batch_first", "named"]

Rule = Callable[[Any, Any, Tensor, Sequence[Batched]], Outcome]
ALL = "all"
"""The default of a dimension argument that, left out, means every dimension."""
SPATIAL = "spatial"
"""The default of an operation on images or sequences: every dimension after (batch, channels)."""


def _arg(args: Any, kwargs: Any, at: int, keys: Sequence[str], default: Any) -> Any:
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


def _broadcast_dims(batched: Sequence[Batched]) -> tuple[int, list[int]]:
    """The dimensions of the operands broadcast together, and each one's rows there."""
    n = max(t.dim() for t, _ in batched)
    return n, [d + n - t.dim() for t, d in batched]


# -- along some dimensions ---------------------------------------------------------------------
def along(
    at: int, default: Any, keys: Sequence[str] = ("dim", "dims"), keeps: bool = False
) -> Rule:
    """Computes along the dimension(s) its argument ``at`` (or keyword ``keys``) names,
    ``default`` when left out; ``keeps``: the argument names the one dimension left alone.
    ``x.flip(0, 1)``: the dimensions as several arguments."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        name = "along"
        n, rows = _broadcast_dims(batched)
        value = _arg(args, kwargs, at, keys, default)
        if len(args) > at + 1 and all(type(a) is int for a in args[at:]):
            value = args[at:]
        if isinstance(value, bool) or not isinstance(value, (int, tuple, list, str, type(None))):
            value = default  # var(x, True): an option where the dimension may be
        named = _dims(value, n)
        dims = set(range(n)) - named if keeps else named
        mixed = [e for (t, d), e in zip(batched, rows) if e in dims and t.shape[d] > 1]
        if mixed:
            return Coupling(name, "it computes over the rows of the batch, along their dimension")
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
                return Coupling(name, outcome.why, outcome.certain)
            return outcome

        return each

    return {name: renamed(name) for name in names}


def rot90(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """Flips one of two dimensions and swaps them (``k`` times): rows flipped are mixed."""
    t, d = batched[0]
    k = _arg(args, kwargs, 1, ("k",), 1) % 4
    a, b = (norm(x, t.dim()) for x in _arg(args, kwargs, 2, ("dims",), (0, 1)))
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
        pair = {norm(_arg(args, kwargs, 2, ("dim1",), first), t.dim())}
        pair.add(norm(_arg(args, kwargs, 3, ("dim2",), second), t.dim()))
        if d in pair:
            return Coupling("diagonal", "it takes the rows of the batch by their position")
        return d - sum(1 for k in pair if k < d)

    return rule


def diag_embed(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """Each vector along the last dimension made the diagonal of a matrix on two new last
    dimensions (by default): rows on the last dimension are placed by their position."""
    t, d = batched[0]
    last_two = _arg(args, kwargs, 2, ("dim1",), -2) in (-2, out.dim() - 2) and _arg(
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
    sizes = _arg(args, kwargs, 1, ("s",), None)
    dims = _arg(args, kwargs, 2, ("dim",), None)
    if dims is None and sizes is not None:
        count = len(sizes) if isinstance(sizes, (tuple, list)) else 1
        dims = tuple(range(-count, 0))
    return along(99, ALL if dims is None else dims, ())(args, kwargs, out, batched)


# -- batch-first -------------------------------------------------------------------------------
def batch_first(what: str, rank: int | None = None) -> Rule:
    """The first operand's first dimension is a batch of independent samples (when it has
    ``rank`` dimensions: the ``1d``/``2d``/``3d`` in the name and two more; with one fewer, it
    is one sample, without that batch dimension)."""
    if rank is None and what[-2:] in ("1d", "2d", "3d"):
        rank = int(what[-2]) + 2

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        x = args[0] if args else None
        first = isinstance(x, Tensor) and any(t is x for t, _ in batched)
        batch = first and (rank is None or args[0].dim() == rank)
        if batch and all(d == 0 for _, d in batched) and out.dim() > 0:
            return 0
        return Coupling(what, "it mixes every dimension but the first, which holds no rows")

    return rule


def per_sample(what: str) -> Rule:
    """Every operand holds one sample per index of its first dimension (a loss with
    ``reduction="none"`` over classes): the rows must be there."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        if all(d == 0 for _, d in batched) and out.dim() > 0:
            return 0
        return Coupling(what, "it computes over the rows of the batch as over classes")

    return rule


def embedding_bag(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """Bags as rows of a 2-D input; bags by offsets in a flat input are not followed."""
    x = args[0]
    if isinstance(x, Tensor) and x.dim() == 2 and all(d == 0 for _, d in batched):
        return 0
    if isinstance(x, Tensor) and x.dim() == 2:
        return Coupling("embedding_bag", "it sums over the rows of the batch")
    return unfollowed("embedding_bag", "its bags are cut from one flat input by offsets")


def padded(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``F.pad``: pairs of sizes from the last dimension back; rows on a padded one mixed."""
    t, d = batched[0]
    pad = _arg(args, kwargs, 1, ("pad",), ())
    padded_dims = {t.dim() - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    if t is not args[0]:
        return unfollowed("pad")
    if d in padded_dims:
        return Coupling("pad", "it adds rows at the ends of the batch")
    return d


# -- matrices on the last two dimensions -------------------------------------------------------
def matrices(what: str, operands: int = 1) -> Rule:
    """Each of the first ``operands`` operands is a stack of matrices on its last two
    dimensions: rows there are mixed, rows on the leading dimensions stay."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        mats = [a for a in args[:operands] if isinstance(a, Tensor)]
        for t, d in batched:
            if any(t is m for m in mats) and d >= t.dim() - 2 and t.shape[d] > 1:
                return Coupling(what, "it treats the rows of the batch as a matrix's")
        rows = _broadcast_dims(batched)[1]
        if len(set(rows)) != 1:
            return unfollowed(what)
        e = rows[0]
        return e if e < out.dim() else unfollowed(what)

    return rule


def attention(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``F.scaled_dot_product_attention``: queries, keys and values are matrices on their last
    two dimensions (sequence, features); rows on the leading ones stay."""
    return matrices("scaled_dot_product_attention", 3)(args, kwargs, out, batched)


def multi_head_attention(
    args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]
) -> Outcome:
    """``F.multi_head_attention_forward``: (sequence, batch, features) queries, keys, values;
    the attention weights (batch, sequence, sequence)."""
    query = args[0]
    if query.dim() == 3 and all(d == 1 for t, d in batched if t.dim() == 3):
        return (1, 0)
    return Coupling("multi_head_attention", "it attends over the rows of the batch")


def recurrent(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
    """``lstm``/``gru``/``rnn_*`` on a padded input (time, batch, features), or (batch, time,
    features) with ``batch_first``; the hidden states (layers, batch, hidden)."""
    x = args[0]
    if len(args) > 1 and isinstance(args[1], Tensor) and args[1].dim() == 1:
        return unfollowed("recurrent", "a packed sequence interleaves the rows")
    first = bool(args[-1]) if isinstance(args[-1], bool) else False
    b = 0 if first else 1
    for t, d in batched:
        if (t is x and d != b) or (t is not x and t.dim() == 3 and d != 1):
            return Coupling("recurrent", "its recurrence runs over the rows of the batch")
    return (b, 1, 1)


# -- positions along a dimension ---------------------------------------------------------------
def positions(at: int, what: str, puts: bool = False) -> Rule:
    """Takes (or ``puts``) positions along the dimension its argument ``at`` names: rows
    there are taken (or written) by their position, unless they are the index's own rows
    taking from a constant (``index_select(table, 0, ids)``: a look-up)."""

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        x = args[0]
        dim = norm(_arg(args, kwargs, at, ("dim",), 0), x.dim())
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
        dim = norm(_arg(args, kwargs, at, keys, default), t.dim())
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
    dim = _arg(args, kwargs, 2, ("dim",), None)
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
_BATCH_FIRST = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "grid_sample", "grid_sampler",
    "affine_grid", "instance_norm", "group_norm", "fold", "im2col", "col2im",
)  # fmt: skip
_PER_SAMPLE = (
    "cross_entropy", "nll_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "cosine_embedding_loss", "triplet_margin_loss",
)  # fmt: skip
_MATRICES = (
    "linalg_inv", "linalg_det", "linalg_slogdet", "linalg_cholesky", "linalg_qr", "linalg_svd",
    "linalg_svdvals", "linalg_eig", "linalg_eigh", "linalg_eigvals", "linalg_eigvalsh",
    "linalg_solve", "linalg_lstsq", "linalg_matrix_exp", "linalg_pinv", "linalg_matrix_power",
    "linalg_matrix_rank", "linalg_cond", "matrix_exp", "svd", "qr", "pinverse", "cholesky_solve",
    "triangular_solve", "linalg_solve_triangular", "linalg_lu_factor", "linalg_lu", "lu",
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
    **named(along(99, ALL), "histc", "bincount"),
    **named(along(2, ALL, ("dim",)), "quantile", "nanquantile", "linalg_vector_norm"),
    **named(along(2, (-2, -1), ("dim",)), "linalg_matrix_norm"),
    **named(along(2, 1, ("dim",)), "normalize"),
    **named(along(99, 1, ()), "local_response_norm"),
    **named(along(2, 0, ("dim",), keeps=True), "renorm"),
    **named(along(99, 1), "fliplr"),
    **named(along(99, 0), "flipud"),
    **named(along(1, 0, ("dimension",)), "unfold"),
    **named(along(99, -1), "pairwise_distance"),
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
    **{name: batch_first(name) for name in _BATCH_FIRST},
    "embedding_bag": embedding_bag,
    **{name: per_sample(name) for name in _PER_SAMPLE},
    "pad": padded,
    **{name: matrices(name) for name in ("inverse", "det", "logdet", "slogdet", "cholesky")},
    **{name: matrices(name) for name in ("nuclear_norm", "geqrf", "matrix_power")},
    **{name: matrices(name, 2) for name in _MATRICES},
    "scaled_dot_product_attention": attention,
    "multi_head_attention_forward": multi_head_attention,
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu"), recurrent),
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
