"""The probe against the numbers: every operation in these tables is run on a batch and on each
half of it; one whose halves do not join into the whole mixes rows, and the probe must refuse it;
one whose halves do must be followed, its rows found where the numbers say they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from tests.core._row_mixing import disagreement, mixes_rows

torch.manual_seed(0)
W = torch.randn(8, 8)
W4 = torch.randn(4, 4)
V = torch.randn(8)
V4 = torch.randn(4)
K3 = torch.randn(5, 3, 3)
K4 = torch.randn(5, 4, 3)
MHA = nn.MultiheadAttention(8, 2).eval()
MHA_FIRST = nn.MultiheadAttention(8, 2, batch_first=True).eval()
LSTM = nn.LSTM(8, 5)
LSTM_FIRST = nn.LSTM(8, 5, batch_first=True)
GRU = nn.GRU(8, 5)
GRU_FIRST = nn.GRU(8, 5, batch_first=True)
CONV = nn.Conv1d(3, 5, 3, padding=1)
BN = nn.BatchNorm1d(8)
BN_EVAL = nn.BatchNorm1d(8).eval()
IN = nn.InstanceNorm1d(3, affine=True)
GN = nn.GroupNorm(1, 3)
LN = nn.LayerNorm(8)
EMB = nn.Embedding(16, 4)


def _set(x, index, value=0.0):
    x = x.clone()
    x[index] = value
    return x


def _flat(x):  # (4, 8) from (4, 3, 8), for the tables' (rows, features) operations
    return x.sum(1)


def _packed(x):
    packed = nn.utils.rnn.pack_padded_sequence(x, [3] * len(x), batch_first=True)
    return nn.utils.rnn.pad_packed_sequence(LSTM_FIRST(packed)[0], batch_first=True)[0]


# Each operation takes (rows=4, tokens=3, features=8).
ROW_WISE = {
    "cdist-to-constants": lambda x: torch.cdist(_flat(x), W),
    "tensordot-with-weights": lambda x: torch.tensordot(x, W, dims=1),
    "inner-with-weights": lambda x: torch.inner(x, W),
    "outer-with-weights": lambda x: torch.outer(x[:, 0, 0], V),
    "cross-on-features": lambda x: torch.linalg.cross(x[..., :3], x[..., 3:6], dim=-1),
    "diff-on-features": lambda x: x.diff(dim=-1),
    "roll-on-features": lambda x: x.roll(1, -1),
    "flip-on-features": lambda x: x.flip(-1),
    "fliplr": lambda x: x.fliplr(),
    "cummax-on-features": lambda x: x.cummax(-1),
    "cummin-on-tokens": lambda x: x.cummin(1).values,
    "cumsum-on-features": lambda x: x.cumsum(2),
    "sort-on-features": lambda x: x.sort(-1),
    "argsort-on-tokens": lambda x: x.argsort(1),
    "topk-on-features": lambda x: x.topk(2, -1),
    "triu-per-row": lambda x: x[:, :, :3].triu(),
    "diagonal-per-row": lambda x: torch.diagonal(x, dim1=1, dim2=2),
    "rfft-on-features": lambda x: torch.fft.rfft(x, dim=-1).abs(),
    "fft2-per-row": lambda x: torch.fft.fft2(x).real,
    "pairwise-distance-to-constants": lambda x: F.pairwise_distance(_flat(x), V),
    "cosine-similarity-on-features": lambda x: F.cosine_similarity(x, x.exp(), dim=-1),
    "normalize-on-features": lambda x: F.normalize(x, dim=-1),
    "instance-norm": lambda x: F.instance_norm(x),
    "group-norm": lambda x: F.group_norm(x, 3),
    "local-response-norm": lambda x: F.local_response_norm(x, 2),
    "pad-features": lambda x: F.pad(x, (1, 1)),
    "unfold-per-row": lambda x: F.unfold(x[:, None], 2),
    "conv1d": lambda x: F.conv1d(x, K3),
    "embedding-bag-per-row": lambda x: F.embedding_bag(
        torch.zeros(len(x), 3, dtype=torch.long), W, per_sample_weights=x[:, :, 0], mode="sum"
    ),
    "index-select-features": lambda x: x.index_select(2, torch.tensor([3, 1])),
    "gather-features": lambda x: x.gather(2, x.argsort(2)[..., :2]),
    "scatter-features": lambda x: x.scatter(2, torch.zeros(len(x), 3, 1, dtype=torch.long), 1.0),
    "masked-select": lambda x: x.masked_select(x > 0),
    "masked-select-broadcast-mask": lambda x: x.masked_select(V[:3, None] > 0),
    "where-row-mask": lambda x: torch.where(x[:, :1, :1] > 0, x, 0.0),
    "repeat-features": lambda x: x.repeat(1, 1, 2),
    "expand": lambda x: x[:, None].expand(-1, 2, -1, -1),
    "tile-features": lambda x: x.tile((1, 2)),
    "repeat-interleave-rows": lambda x: x.repeat_interleave(2, dim=0),
    "chunk-features": lambda x: x.chunk(2, -1)[0],
    "split-features-and-cat": lambda x: torch.cat(x.split(3, dim=-1)[::-1], -1),
    "flatten-all": lambda x: x.view(-1),
    "rows-by-pairs": lambda x: x.view(-1, 48).tanh(),
    "sum-on-features": lambda x: x.sum(-1),
    "max-of-two": lambda x: torch.max(x, x.flip(-1)),
    "norm-on-features": lambda x: x.norm(2, -1),
    "var-on-features": lambda x: x.var(-1, True),
    "in-place-column": lambda x: _set(x, (slice(None), 0)),
    "in-place-mask": lambda x: _set(x, x > 0),
    "getitem-features-by-tensor": lambda x: x[:, :, torch.tensor([1, 0])],
    "getitem-ellipsis-none": lambda x: x[..., None, 1:],
    "getitem-none": lambda x: x[None],
    "getitem-row-mask": lambda x: x[x[:, 0, 0] > 0],
    "getitem-one-per-row": lambda x: x[torch.arange(len(x)), x[:, :, 0].argmax(1)],
    "argmax-on-features": lambda x: x.argmax(-1),
    "any-on-features": lambda x: x * (x > 0).any(-1, keepdim=True),
    "routing-by-counts": lambda x: x * (x > 0).sum(-1, keepdim=True),
    "transpose-property": lambda x: x.mT,
    "rot90": lambda x: x.rot90(),
    "real": lambda x: torch.view_as_complex(x.unflatten(-1, (4, 2))).real,
    "einsum-outer-per-row": lambda x: torch.einsum("bti,btj->btij", x, x),
    "einsum-ellipsis": lambda x: torch.einsum("...i,...i->...", x, x),
    "einsum-weights": lambda x: torch.einsum("ij,btj->bti", W, x),
    "addmm": lambda x: torch.addmm(V, _flat(x), W),
    "baddbmm": lambda x: torch.baddbmm(x[:, :, :3], x, x.mT),
    "matmul-broadcast": lambda x: x @ W,
    "matrix-vector": lambda x: x @ V,
    "vector-matrix": lambda x: V4[:3] @ x,
    "mv": lambda x: torch.mv(_flat(x), V),
    "sdpa-rows-first": lambda x: F.scaled_dot_product_attention(x, x, x),
    "mha-batch-first": lambda x: MHA_FIRST(x, x, x)[0],
    "mha-rows-on-dim-1": lambda x: MHA(*(x.transpose(0, 1),) * 3)[0],
    "lstm-batch-first": lambda x: LSTM_FIRST(x),
    "lstm-rows-on-dim-1": lambda x: LSTM(x.transpose(0, 1)),
    "gru-batch-first": lambda x: GRU_FIRST(x)[0],
    "conv1d-module": lambda x: CONV(x),
    "batch-norm-eval": lambda x: BN_EVAL(_flat(x)),
    "instance-norm-module": lambda x: IN(x),
    "group-norm-module": lambda x: GN(x),
    "layer-norm-module": lambda x: LN(x),
    "embedding": lambda x: EMB((x[:, :, 0] > 0).long()),
}
COUPLED = {
    "cdist": lambda x: torch.cdist(_flat(x), _flat(x).exp()),
    "cdist-to-itself": lambda x: (lambda rows: torch.cdist(rows, rows))(_flat(x)),
    "pdist": lambda x: F.pdist(_flat(x)),
    "cov": lambda x: torch.cov(_flat(x)),
    "corrcoef": lambda x: torch.corrcoef(_flat(x)),
    "tensordot-pairs": lambda x: torch.tensordot(x, x, dims=([1, 2], [1, 2])),
    "tensordot-over-rows": lambda x: torch.tensordot(x, x, dims=([0], [0])),
    "inner-pairs": lambda x: torch.inner(_flat(x), _flat(x)),
    "outer-pairs": lambda x: torch.outer(x[:, 0, 0], x[:, 0, 1]),
    "kron": lambda x: torch.kron(_flat(x), _flat(x)),
    "diff-on-rows": lambda x: x.diff(dim=0),
    "roll-on-rows": lambda x: x.roll(1, 0),
    "roll-flat": lambda x: x.roll(1),
    "flip-rows": lambda x: x.flip(0),
    "flipud": lambda x: x.flipud(),
    "rot90-twice": lambda x: x.rot90(2),
    "cummax-on-rows": lambda x: x.cummax(0),
    "cummin-on-rows": lambda x: x.cummin(0).values,
    "cumsum-on-rows": lambda x: x.cumsum(0),
    "sort-on-rows": lambda x: x.sort(0),
    "argsort-on-rows": lambda x: x.argsort(0),
    "topk-on-rows": lambda x: x.topk(2, 0),
    "unique": lambda x: torch.unique(x.round()),
    "unique-columns": lambda x: torch.unique(x.round(), dim=1),
    "norm-over-rows": lambda x: x.norm(2, 0),
    "triu-rows": lambda x: _flat(x)[:, :4].triu(),
    "tril-rows": lambda x: _flat(x)[:, :4].tril(),
    "diag": lambda x: torch.diag(_flat(x)[:, :4]),
    "rfft-on-rows": lambda x: torch.fft.rfft(x, dim=0).abs(),
    "fft2-rows": lambda x: torch.fft.fft2(_flat(x)).real,
    "pairwise-distance-reversed": lambda x: F.pairwise_distance(x[:, 0], x[:, 1].flip(0)),
    "cosine-similarity-on-rows": lambda x: F.cosine_similarity(x, x.exp(), dim=0),
    "normalize-on-rows": lambda x: F.normalize(x, dim=0),
    "instance-norm-rows-as-length": lambda x: F.instance_norm(x.permute(1, 2, 0)),
    "group-norm-rows-as-channels": lambda x: F.group_norm(x.transpose(0, 1), 1),
    "local-response-norm-rows-as-channels": lambda x: F.local_response_norm(x.transpose(0, 1), 2),
    "pad-rows": lambda x: F.pad(x, (0, 0, 0, 0, 1, 1)),
    "unfold-rows": lambda x: F.unfold(x.permute(1, 0, 2)[None], 2),
    "conv1d-rows-as-channels": lambda x: F.conv1d(x.transpose(0, 1), K4),
    "conv1d-rows-as-length": lambda x: F.conv1d(x.permute(1, 2, 0), torch.randn(5, 8, 2)),
    "embedding-bag-offsets": lambda x: F.embedding_bag(
        torch.zeros(12, dtype=torch.long),
        W,
        torch.tensor([0, 3, 6, 9]),
        per_sample_weights=x[:, :, 0].flatten(),
        mode="sum",
    ),
    "index-select-rows": lambda x: x.index_select(0, torch.tensor([3, 1])),
    "gather-rows": lambda x: x.gather(0, x.argsort(0)),
    "scatter-rows": lambda x: x.scatter(0, torch.zeros(1, 3, 8, dtype=torch.long), 1.0),
    "repeat-rows": lambda x: x.repeat(2, 1, 1),
    "tile-rows": lambda x: x.tile((2, 1, 1)),
    "chunk-rows": lambda x: x.chunk(2, 0)[0],
    "split-rows-swapped": lambda x: torch.cat(x.split(2)[::-1]),
    "unbind-rows": lambda x: x.unbind(0)[1],
    "transpose-then-reshape": lambda x: x.transpose(0, 2).reshape(-1, 3, 8),
    "flatten-then-softmax": lambda x: x.flatten().softmax(0),
    "sum-of-everything": lambda x: x.sum(),  # one value of the batch: the loss's business
    "max-of-everything": lambda x: x.max(),
    "statistics-of-everything": lambda x: torch.var_mean(x),
    "view-then-softmax-over-rows": lambda x: x.view(-1, 8).softmax(0),
    "in-place-row": lambda x: _set(x, 0),
    "in-place-row-slice": lambda x: _set(x, slice(1, None)),
    "in-place-batch-mean": lambda x: x.clone().add_(x.mean(0)),
    "masked-scatter-from-constants": lambda x: x.masked_scatter(x > 0, torch.arange(96.0)),
    "masked-scatter-from-rows": lambda x: x.masked_scatter(x > 0, x.exp()),
    "in-place-index-fill": lambda x: x.clone().index_fill_(0, torch.tensor([1]), 0.0),
    "getitem-rows-by-tensor": lambda x: x[torch.tensor([1, 0, 3, 2])],
    "getitem-rows-by-list": lambda x: x[[0, 1]],
    "getitem-row-slice": lambda x: x[1:],
    "getitem-row-step": lambda x: x[::3],
    "getitem-row-ellipsis": lambda x: x[1, ...],
    "argmax-on-rows": lambda x: x.argmax(0),
    "any-over-rows-as-a-mask": lambda x: x * (x > 0).any(0).float(),
    "counts-over-rows-as-weights": lambda x: x / (x > 0).sum(0).clamp(min=1),
    "columns-chosen-over-rows": lambda x: x[:, :, (x[:, 0] > 0).all(0)],
    "written-where-any-row-is": lambda x: _set(x, (slice(None), slice(None), (x[:, 0] > 0).any(0))),
    "einsum-pairs": lambda x: torch.einsum("bti,cti->bc", x, x),
    "einsum-over-rows": lambda x: torch.einsum("bti->ti", x),
    "einsum-ellipsis-pairs": lambda x: torch.einsum("b...,c...->bc", x, x),
    "addmm-over-rows": lambda x: torch.addmm(V, W4, x[:, 0]),
    "baddbmm-pairs": lambda x: torch.baddbmm(
        torch.tensor(1.0), x.transpose(0, 1), x.permute(1, 2, 0)
    ),
    "matmul-over-rows": lambda x: W4[:3] @ x.transpose(0, 1),
    "vector-over-rows": lambda x: V4 @ x[:, 0],
    "mv-over-rows": lambda x: torch.mv(x[:, 0].T, V4),
    "sdpa-rows-as-sequence": lambda x: F.scaled_dot_product_attention(*(x.transpose(0, 1),) * 3),
    "mha-rows-as-sequence": lambda x: MHA(x, x, x)[0],
    "lstm-rows-as-time": lambda x: LSTM(x)[0],
    "gru-rows-as-time": lambda x: GRU(x),
    "conv1d-module-rows-as-length": lambda x: CONV(x.permute(1, 2, 0)[:, :3]),
    "batch-norm-training": lambda x: BN(_flat(x)),
    "layer-norm-over-rows": lambda x: F.layer_norm(x.transpose(0, 2), (4,)),
    "softmax-over-flattened-rows": lambda x: x.reshape(-1, 8).softmax(0),
}
REFUSED_THOUGH_ROW_WISE = {
    "split-rows-and-cat": lambda x: torch.cat(x.split(2)),
    "unbind-rows-and-stack": lambda x: torch.stack(x.unbind(0)),
    "packed-sequence": _packed,
}
"""Row-wise in the end, through values that hold the rows in an order the probe does not follow
(a part of the rows by position, a packed sequence's time-major data): refused, never guessed."""


def _x() -> torch.Tensor:
    return torch.randn(4, 3, 8)


@pytest.mark.parametrize("name", list(ROW_WISE))
def test_row_wise_operations_are_followed(name: str) -> None:
    x = _x()
    assert not mixes_rows(ROW_WISE[name], x), "the table is wrong: it mixes rows"
    assert disagreement(ROW_WISE[name], x) is None


@pytest.mark.parametrize("name", list(COUPLED))
def test_operations_mixing_rows_are_refused(name: str) -> None:
    x = _x()
    assert mixes_rows(COUPLED[name], x), "the table is wrong: it is row-wise"
    assert disagreement(COUPLED[name], x) is None


@pytest.mark.parametrize("name", list(REFUSED_THOUGH_ROW_WISE))
def test_what_the_probe_cannot_follow_is_refused_by_name(name: str) -> None:
    x = _x()
    assert not mixes_rows(REFUSED_THOUGH_ROW_WISE[name], x)
    problem = disagreement(REFUSED_THOUGH_ROW_WISE[name], x)
    assert problem is not None and "cannot follow" in problem


# -- in a pipe: the plain model's numbers, or a refusal before any step -----------------------
class _Op(nn.Module):
    """One operation of the tables on (rows, 3, 8) activations, summed per row after."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x):
        out = self.op(x.view(-1, 3, 8))
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(len(x), -1).sum(-1, keepdim=True)


def _chain(op) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 24), nn.Tanh(), _Op(op), nn.Linear(1, 2))


PIPED = {
    "cdist-to-constants": (ROW_WISE, False),
    "matrix-vector": (ROW_WISE, False),
    "lstm-batch-first": (ROW_WISE, False),
    "getitem-one-per-row": (ROW_WISE, False),
    "flip-rows": (COUPLED, True),
    "cummax-on-rows": (COUPLED, True),
    "sdpa-rows-as-sequence": (COUPLED, True),
    "lstm-rows-as-time": (COUPLED, True),
    "in-place-row": (COUPLED, True),
    "getitem-row-slice": (COUPLED, True),
    "repeat-rows": (COUPLED, True),  # more rows inside the layer, the batch's after it
    "any-over-rows-as-a-mask": (COUPLED, True),
    "mha-rows-as-sequence": (COUPLED, True),
    "mha-batch-first": (ROW_WISE, False),
}


@pytest.mark.parametrize("name", list(PIPED))
def test_a_pipe_gives_the_plain_models_numbers_or_refuses_before_any_step(name: str) -> None:
    table, refused = PIPED[name]
    x, y = torch.randn(8, 24), torch.randn(8, 2)
    plain = _chain(table[name])
    pipe = pipepar.wrap(_chain(table[name]), [2, 2], devices=["cpu", "cpu"], chunks=2)
    if refused:
        with pytest.raises(pipepar.BatchCoupled, match=r"mix rows of the batch|mixes rows"):
            pipe(x)
        with pytest.raises(pipepar.BatchCoupled):
            pipe.step(x, y, F.mse_loss)
        assert all(p.grad is None for p in pipe.parameters())
        return
    torch.testing.assert_close(pipe(x), plain(x))
    loss = pipe.step(x, y, F.mse_loss)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class _Ranked(nn.Module):
    """A model with its own forward whose scores compare every row with every other through
    ``torch.cdist``: the pipe cuts its forward into stages as it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.cdist(x, x).softmax(-1).sum(-1)


def test_a_cut_model_refuses_distances_between_rows_or_steps_exactly() -> None:
    torch.manual_seed(0)
    model, plain = _Ranked(), _Ranked()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 8)
    pipe = pipepar.wrap(model, split=["layers.1"], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match=r"cdist\(\).*mixes rows"):
        pipe(x)
    try:
        loss = pipe.step(x, loss_fn=lambda out, target: out.pow(2).mean(), target=None)
    except pipepar.BatchCoupled:
        assert all(p.grad is None for p in model.parameters())
        return
    expected = plain(x).pow(2).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_experts_picked_by_counts_of_the_batch_step_exactly() -> None:
    """transformers' eager experts loop over the experts the batch hits (a count over its
    tokens, ``nonzero``) and scatter the tokens back with ``index_add_``: routing, each token
    computed from itself, so the counts reach no number and the step is the plain model's."""
    from tests.program._data_models import batch, build

    plain, model = build("mixtral", experts="eager"), build("mixtral", experts="eager")
    pipe = pipepar.wrap(model, split=["model.layers.1"], devices=["cpu", "cpu"], chunks=2)
    loss = pipe.step(**batch())
    expected = plain(**batch()).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
