"""Real models as users bring them: transformers' GPT-2, Llama and BERT, timm's and
torchvision's ViT, built from sizes with random weights (nothing is downloaded).

Each builder returns the library's own model class, unchanged (not an ``nn.Sequential``), and
takes ``device=`` (``"meta"`` builds without memory). Dropout is off by default so a pipe and
the plain model compute the same numbers; pass ``dropout=0.1`` for training runs.
:func:`sample` makes a matching synthetic batch.

    >>> from models import transformers_zoo as zoo
    >>> model = zoo.gpt2(layers=2)
    >>> out = model(**zoo.sample("gpt2", batch=2, seq=8))
    >>> out.logits.shape
    torch.Size([2, 8, 128])

transformers and timm are imported by the builders that need them only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipepar.zoo.llama import llama, llama3_70b

__all__ = [
    "NAMES",
    "bert",
    "build",
    "gpt2",
    "llama",
    "llama3_70b",
    "sample",
    "vit_timm",
    "vit_torchvision",
]

VOCAB = 128
IMAGE = 32


def _on(device: str | torch.device | None, make: Callable[[], nn.Module]) -> nn.Module:
    if device is None:
        return make()
    with torch.device(device):
        return make()


def gpt2(
    *,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 2,
    vocab: int = VOCAB,
    positions: int = 64,
    dropout: float = 0.0,
    device: str | torch.device | None = None,
) -> nn.Module:
    """transformers' ``GPT2LMHeadModel``: the head's weight is the token embedding's (tied)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _on(device, lambda: GPT2LMHeadModel(config))


def bert(
    *,
    layers: int = 4,
    hidden: int = 32,
    intermediate: int = 64,
    heads: int = 2,
    vocab: int = VOCAB,
    dropout: float = 0.0,
    device: str | torch.device | None = None,
) -> nn.Module:
    """transformers' ``BertForMaskedLM``: the decoder's weight is the word embedding's (tied)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        vocab_size=vocab,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
    )
    return _on(device, lambda: BertForMaskedLM(config))


def vit_timm(
    *,
    layers: int = 4,
    hidden: int = 48,
    heads: int = 3,
    classes: int = 10,
    dropout: float = 0.0,
    device: str | torch.device | None = None,
) -> nn.Module:
    """timm's ``VisionTransformer`` on 32x32 images in 8x8 patches (class token, position
    embedding as parameters of the model itself)."""
    from timm.models.vision_transformer import VisionTransformer

    return _on(
        device,
        lambda: VisionTransformer(
            img_size=IMAGE,
            patch_size=8,
            embed_dim=hidden,
            depth=layers,
            num_heads=heads,
            num_classes=classes,
            drop_rate=dropout,
        ),
    )


def vit_torchvision(
    *,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 2,
    classes: int = 10,
    dropout: float = 0.0,
    device: str | torch.device | None = None,
) -> nn.Module:
    """torchvision's ``VisionTransformer`` on 32x32 images in 8x8 patches. Its head starts at
    zero (torchvision's choice); it is drawn at random here so gradients reach every layer."""
    from torchvision.models import VisionTransformer

    def make() -> nn.Module:
        model = VisionTransformer(
            image_size=IMAGE,
            patch_size=8,
            num_layers=layers,
            num_heads=heads,
            hidden_dim=hidden,
            mlp_dim=2 * hidden,
            num_classes=classes,
            dropout=dropout,
        )
        if device != "meta":
            nn.init.normal_(model.heads.head.weight, std=0.02)
        return model

    return _on(device, make)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit_timm": vit_timm,
    "vit_torchvision": vit_torchvision,
}
NAMES = tuple(_BUILDERS)


def build(name: str, **options: Any) -> nn.Module:
    """The model ``name`` (one of :data:`NAMES`) with ``options`` passed to its builder."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(NAMES)}")
    return _BUILDERS[name](**options)


def sample(
    name: str,
    *,
    batch: int = 8,
    seq: int = 16,
    vocab: int = VOCAB,
    labels: bool = True,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A synthetic batch for model ``name`` as keyword arguments (with ``labels=`` for the
    language models, which then return their own loss)."""
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("vit"):
        return {"x": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        out["labels"] = ids.clone()
    return out


def padded_sample(name: str, *, batch: int = 6, seq: int = 12, seed: int = 0) -> dict[str, Any]:
    """A language-model batch of different lengths, as real training data is: right padding
    (attention mask 0, label -100), a prompt not trained on (labels -100) in row 2, rows 1 and
    3 without any label, and for BERT labels only at some (masked) positions."""
    out = sample(name, batch=batch, seq=seq, seed=seed)
    lengths = [seq, 3, seq - 2, 1, 7, seq] * (batch // 6 + 1)
    for r in range(batch):
        out["attention_mask"][r, lengths[r] :] = 0
        out["labels"][r, lengths[r] :] = -100
    out["labels"][2 % batch, :5] = -100
    out["labels"][1 % batch, :] = -100
    out["labels"][3 % batch, :] = -100
    if name == "bert":
        gen = torch.Generator().manual_seed(seed + 1)
        out["labels"][torch.rand(out["labels"].shape, generator=gen) >= 0.4] = -100
    return out
