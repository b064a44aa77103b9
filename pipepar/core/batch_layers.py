"""Layers whose operands' dimensions have roles, and what each role does to the rows of the
batch.

* *batch-first* (convolutions, instance and group norm, im2col, losses per sample): the first
  dimension is a batch of independent samples, every other one is mixed;
* *matrices* on the last two dimensions (linear algebra, attention's sequence and features):
  rows on those are mixed, rows on the leading (batch) dimensions stay;
* attention with (sequence, batch, features) operands, and recurrent layers (time, batch,
  features; batch first on request): rows on the sequence or time are mixed;
* ``F.pad``: rows on a padded dimension are mixed (rows added at the ends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from pipepar.core.batch_dim_families import Rule, argument, broadcast_dims
from pipepar.core.batch_outcome import Batched, Coupling, Outcome, unfollowed

__all__ = ["LAYERS", "batch_first"]


def batch_first(what: str, rank: int | None = None, samples: int = 1) -> Rule:
    """The first operand's first dimension is a batch of independent samples (when it has
    ``rank`` dimensions: the ``1d``/``2d``/``3d`` in the name and two more; with one fewer, it
    is one sample, without that batch dimension); so is the next operands' up to ``samples``
    (``grid_sample``'s grid). Rows in any other operand (a convolution's weights) pair every
    row with every other."""
    if rank is None and what[-2:] in ("1d", "2d", "3d"):
        rank = int(what[-2]) + 2

    def rule(args: Any, kwargs: Any, out: Tensor, batched: Sequence[Batched]) -> Outcome:
        x = args[0] if args else None
        per_sample = [a for a in args[:samples] if isinstance(a, Tensor)]
        if any(not any(t is a for a in per_sample) for t, _ in batched):
            return Coupling(what, "the rows of the batch are in its weights")
        batch = isinstance(x, Tensor) and (rank is None or x.dim() == rank)
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
    pad = argument(args, kwargs, 1, ("pad",), ())
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
        rows = broadcast_dims(batched)[1]
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


_BATCH_FIRST = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
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
LAYERS: dict[str, Rule] = {
    **{name: batch_first(name) for name in _BATCH_FIRST},
    **{name: batch_first(name, samples=2) for name in ("grid_sample", "grid_sampler")},
    "embedding_bag": embedding_bag,
    **{name: per_sample(name) for name in _PER_SAMPLE},
    "pad": padded,
    **{name: matrices(name) for name in ("inverse", "det", "logdet", "slogdet", "cholesky")},
    **{name: matrices(name) for name in ("nuclear_norm", "geqrf", "matrix_power")},
    **{name: matrices(name, 2) for name in _MATRICES},
    "scaled_dot_product_attention": attention,
    "multi_head_attention_forward": multi_head_attention,
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu"), recurrent),
}
"""The layers' rules, by the operation's name."""
