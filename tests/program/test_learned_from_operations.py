"""Models from transformers and code written without pipepar in mind: what micro-batching may
change is learned from their operations (their own losses joined exactly, code mixing rows of
the batch refused by name), in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from tests._foreign_models import PairLogits

transformers = pytest.importorskip("transformers")


def _clip() -> nn.Module:
    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.CLIPConfig(
        text_config=dict(tower, vocab_size=100, max_position_embeddings=16),
        vision_config=dict(tower, image_size=16, patch_size=8),
        projection_dim=16,
    )
    return transformers.CLIPModel(config)


def _mixtral(router: bool) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=router,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def test_clip_contrastive_loss_is_refused_naming_the_product() -> None:
    model = _clip()
    ids, pixels = torch.randint(0, 100, (4, 8)), torch.randn(4, 3, 16, 16)
    pipe = pipepar.wrap(model, split=["text_model.encoder.layers.1"], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match=r"matmul\(\) in module CLIPModel"):
        pipe.step(input_ids=ids, pixel_values=pixels, return_loss=True)
    assert all(p.grad is None for p in model.parameters())
    whole = pipepar.wrap(
        model, split=["text_model.encoder.layers.1"], devices=["cpu"] * 2, chunks=1
    )
    expected = model(input_ids=ids, pixel_values=pixels, return_loss=True).loss
    got = whole.step(input_ids=ids, pixel_values=pixels, return_loss=True)
    torch.testing.assert_close(got, expected.detach())


def test_a_router_loss_over_all_tokens_is_refused_unless_micro_batches_are_asked_for() -> None:
    ids = torch.randint(0, 64, (4, 8))
    pipe = pipepar.wrap(_mixtral(True), split=["model.layers.1"], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match="rows of the batch"):
        pipe.step(input_ids=ids, labels=ids)
    accepting = pipepar.wrap(
        _mixtral(True), split=["model.layers.1"], devices=["cpu"] * 2, chunks=2,
        batch_coupling="per-micro-batch",
    )  # fmt: skip
    loss = accepting.step(input_ids=ids, labels=ids)  # the loss, not its aux_loss beside it
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("build", "split"),
    [
        (lambda: _mixtral(False), "model.layers.1"),
        (_t5, "decoder.block.0"),
        (_bert, "bert.encoder.layer.1"),
    ],
    ids=["mixtral", "t5", "bert"],
)
def test_own_token_losses_join_exactly(build, split: str) -> None:
    plain, model = build(), build()
    ids = torch.randint(1, 64, (4, 8))
    labels = ids.clone()
    labels[:2, 3:] = -100  # micro-batch 0 holds fewer real labels than micro-batch 1
    kwargs = dict(input_ids=ids, labels=labels)
    expected = plain(**kwargs).loss
    expected.backward()
    pipe = pipepar.wrap(model, split=[split], devices=["cpu"] * 2, chunks=2, schedule="1f1b")
    for _ in range(2):  # learned on the first call, followed on the second
        model.zero_grad()
        torch.testing.assert_close(pipe.step(**kwargs), expected.detach(), rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


class _ConvBN(nn.Module):
    """A conv net as torchvision and timm write them: batch norm inside its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def _contrastive_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target)


@pytest.mark.parametrize(
    ("build", "split", "args", "target", "op"),
    [
        (_ConvBN, "body", (torch.randn(8, 3, 8, 8),), torch.randint(0, 5, (8,)), "batch_norm"),
        (PairLogits, "text", (torch.randn(8, 8), torch.randn(8, 8)), torch.arange(8), "matmul"),
    ],
    ids=["batch-norm", "contrastive"],
)
def test_a_step_with_a_loss_fn_is_refused_where_the_model_mixes_rows(
    build, split: str, args: tuple[torch.Tensor, ...], target: torch.Tensor, op: str
) -> None:
    """The model's own code mixing rows stops ``step(..., loss_fn=...)`` before any gradient,
    as it stops ``pipe(...)``: the loss function cannot undo what each micro-batch computed
    from its own rows."""
    torch.manual_seed(0)
    model = build()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=[split], devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    with pytest.raises(pipepar.BatchCoupled, match=op):
        pipe.step(*args, loss_fn=_contrastive_loss, target=target)
    assert all(p.grad is None for p in model.parameters())
    whole = pipepar.wrap(model, split=[split], devices=["cpu"] * 2, chunks=1)
    got = whole.step(*args, loss_fn=_contrastive_loss, target=target)  # one micro-batch: exact
    expected = _contrastive_loss(plain(*args), target)
    torch.testing.assert_close(got, expected.detach())


def _spread(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.var(0).sum() + torch.nn.functional.mse_loss(out, target)


def _centred(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - out.mean(0)) - target).pow(2).mean()


@pytest.mark.parametrize("loss_fn", [_spread, _centred], ids=["var", "centred"])
@pytest.mark.parametrize("chain", [True, False], ids=["sequential", "module"])
def test_a_loss_fn_mixing_the_outputs_rows_is_refused(loss_fn, chain: bool) -> None:
    """A loss over the model's output rows (``out.var(0)``, ``out - out.mean(0)``) would be
    computed on each micro-batch's rows: refused before any gradient, for an ``nn.Sequential``
    and for any other model (each micro-batch's loss was silently another number)."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    model = nn.Sequential(a, nn.Tanh(), b) if chain else _TwoLayers(a, b)
    pipe = pipepar.wrap(model, split=["2" if chain else "b"], devices=["cpu"] * 2, chunks=2)
    x, target = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(pipepar.BatchCoupled, match="in loss_fn mixes rows of the batch"):
        pipe.step(x, target=target, loss_fn=loss_fn)
    assert all(p.grad is None for p in model.parameters())


class _TwoLayers(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))
