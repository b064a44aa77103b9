"""Operations that mix rows of the batch, found from what the code does (pipepar.core.batch_dims
through the probe), and what a pipe does with them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.core.reductions import BatchCoupled, Probe
from tests._foreign_models import Contrastive, Towers, contrastive_loss

W = torch.randn(8, 8)

COUPLED = {
    "contrastive-logits": lambda x: F.normalize(x @ W, dim=-1) @ F.normalize(x, dim=-1).t(),
    "batch-mean": lambda x: x - x.mean(0),
    "batch-norm-training": lambda x: F.batch_norm(x, None, None, training=True),
    "softmax-over-rows": lambda x: x.softmax(0),
    "pairwise-distances": lambda x: (x[:, None] - x[None]).pow(2).sum(-1),
    "a-row-by-position": lambda x: x[0] * 2,
    "gram-matrix": lambda x: x.t() @ x,
    "gram-of-rows-by-property": lambda x: x @ x.T,
    "pairs-by-matrix-transpose": lambda x: x @ x.mT,
    "pairs-by-adjoint": lambda x: x.H.T @ x.H,
    "einsum-pairs": lambda x: torch.einsum("bi,ci->bc", x, x),
    "gram-with-its-operand-by-keyword": lambda x: torch.matmul(x.t(), other=x),
    "router-statistics": lambda x: F.one_hot(x.argmax(-1), 8).float().view(-1, 8).mean(0),
}
ROW_WISE = {
    "mlp": lambda x: torch.tanh(x @ W).sum(-1),
    "attention": lambda x: F.scaled_dot_product_attention(
        *(x.view(4, 2, 1, 4).expand(4, 2, 3, 4),) * 3
    ),
    "views": lambda x: x.view(4, 2, 4).transpose(1, 2).reshape(4, 8).softmax(-1),
    "layer-norm": lambda x: F.layer_norm(x, (8,)),
    "bmm": lambda x: torch.bmm(x.view(4, 2, 4), x.view(4, 4, 2)),
    "einsum": lambda x: torch.einsum("bi,ij->bj", x, W),
    "routing-counts": lambda x: (x > 0).long().sum(0),  # an integer count of the batch: dispatch
    "cat-on-rows": lambda x: torch.cat([x, x]).relu(),
    "transposed-by-property": lambda x: (W @ x.T).T.softmax(-1),
    "batched-transpose": lambda x: (x.view(4, 2, 4).mT @ x.view(4, 2, 4)).softmax(-1),
    # operands named by keyword, as BLOOM's attention passes them: read as by position
    "baddbmm-by-keyword": lambda x: torch.zeros(4, 2, 2).baddbmm(
        batch1=x.view(4, 2, 4), batch2=x.view(4, 4, 2), beta=0.5, alpha=2.0
    ),
    "addmm-by-keyword": lambda x: torch.addmm(torch.zeros(8), mat1=x, mat2=W),
    "matmul-by-keyword": lambda x: torch.matmul(x, other=W).relu(),
}


def _run(fn) -> None:
    x = torch.randn(4, 8)
    with Probe([x], rows=4):
        fn(x)


@pytest.mark.parametrize("name", list(COUPLED))
def test_operations_mixing_rows_are_found(name: str) -> None:
    with pytest.raises(BatchCoupled, match="mixes rows of the batch"):
        _run(COUPLED[name])


@pytest.mark.parametrize("name", list(ROW_WISE))
def test_row_wise_code_is_not_flagged(name: str) -> None:
    _run(ROW_WISE[name])


# -- in a pipe --------------------------------------------------------------------------------
class _KeywordAttention(nn.Module):
    """Attention scores made as BLOOM makes them: a bias of the batch, ``baddbmm`` with its
    matrices and factors named by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).view(x.shape[0], 2, 8).unbind(1)  # (rows, 8) each
        bias = x[:, :1, None].expand(-1, 2, 2) * 0.1  # a bias per row, like ALiBi's
        scores = bias.baddbmm(batch1=q.view(-1, 2, 4), batch2=k.view(-1, 4, 2), beta=1.0,
                              alpha=0.5)  # fmt: skip
        return torch.matmul(scores.softmax(-1).flatten(1), other=torch.ones(4, 8))


def test_operands_named_by_keyword_are_followed_and_train_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _KeywordAttention(), nn.Linear(8, 8), nn.ReLU())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    pipe = pipepar.wrap(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    assert torch.allclose(loss, F.mse_loss(plain(x), y), rtol=1e-6)
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7), name


def test_contrastive_logits_stop_before_any_gradient_unless_accepted() -> None:
    torch.manual_seed(0)
    model = Contrastive()
    images, texts = torch.randn(8, 8), torch.randn(8, 8)
    pipe = pipepar.wrap(model, split=["text.0"], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(BatchCoupled, match="matmul"):
        pipe.step(images, texts)
    assert all(p.grad is None for p in model.parameters())
    accepting = pipepar.wrap(
        model, split=["text.0"], devices=["cpu", "cpu"], chunks=2, batch_coupling="per-micro-batch"
    )
    accepting.step(images, texts)  # each micro-batch's own contrastive loss, as asked
    one = pipepar.wrap(model, split=["text.0"], devices=["cpu", "cpu"], chunks=1)
    model.zero_grad()
    torch.testing.assert_close(one.step(images, texts), model(images, texts).detach())


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.mean((1, 2, 3))


def test_batch_norm_in_training_needs_deferral_or_acceptance() -> None:
    x = torch.randn(4, 3, 6, 6)
    pipe = pipepar.wrap(_ConvNet(), split=["blocks.1"], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(BatchCoupled, match="batch_norm"):
        pipe(x)
    deferred = pipepar.wrap(
        _ConvNet(), split=["blocks.1"], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True
    )
    deferred(x)
    evaluating = pipepar.wrap(
        _ConvNet().eval(), split=["blocks.1"], devices=["cpu", "cpu"], chunks=2
    )
    evaluating(x)  # running statistics: each row on its own


def _bn_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("balance", [[2, 2], [4]], ids=["two-stages", "one-stage"])
def test_a_chains_batch_norm_in_training_is_refused_unless_deferred(balance: list[int]) -> None:
    x = torch.randn(8, 8)
    devices = ["cpu"] * len(balance)
    pipe = pipepar.wrap(_bn_chain(), balance, devices=devices, chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match=r"batch_norm.*layer 1"):
        pipe(x)
    with pytest.raises(pipepar.BatchCoupled):  # refused again: a refused kind is not learned
        pipe(x)
    pipepar.wrap(_bn_chain(), balance, devices=devices, chunks=2, deferred_batch_norm=True)(x)
    pipepar.wrap(_bn_chain(), balance, devices=devices, chunks=1)(x)  # one micro-batch: exact
    pipepar.GPipe(_bn_chain(), balance, devices=devices, chunks=2)(x)  # torchgpipe's semantics


def test_coupled_code_trains_exactly_on_what_the_pipe_returns() -> None:
    """The way out the README gives: the model returns per-row embeddings, the contrastive
    loss is computed on the whole batch's rows the pipe returns."""
    torch.manual_seed(0)
    plain = Towers()
    model = Towers()
    model.load_state_dict(plain.state_dict())
    images, texts = torch.randn(8, 8), torch.randn(8, 8)
    expected = contrastive_loss(*plain(images, texts))
    expected.backward()
    pipe = pipepar.wrap(model, split=["text.0"], devices=["cpu", "cpu"], chunks=4)
    loss = contrastive_loss(*pipe(images, texts))
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
