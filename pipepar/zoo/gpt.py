"""A GPT-style decoder stack as one flat ``nn.Sequential`` whose layers pass one tensor on.

Layout of ``gpt(depth=L)``: ``Embedding`` (token ids ``(N, T)`` -> ``(N, T, width)``), then
``L`` pre-norm ``Block`` s, then ``LayerNorm``, then the ``Linear`` head to ``vocab`` logits:
``L + 3`` layers. The head is not tied to the token embedding: tied weights would be one
parameter shared by the first and the last stage, which a pipeline cannot place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipepar.zoo.building import DeviceLike, on_device

__all__ = ["Block", "Embedding", "gpt"]


class Embedding(nn.Module):
    """Token plus learned position embedding: ids ``(N, T)`` -> ``(N, T, width)``.

    Example:
        >>> embed = Embedding(vocab=100, width=8, seq_len=16)
        >>> embed(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, vocab: int, width: int, seq_len: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.shape[-1]
        if seq_len > self.positions.num_embeddings:
            raise ValueError(
                f"input has {seq_len} tokens but the model was built with "
                f"seq_len={self.positions.num_embeddings}; build it with seq_len>={seq_len}"
            )
        where = torch.arange(seq_len, device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(where))


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP.

    Example:
        >>> block = Block(width=32, heads=4)
        >>> block(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, width: int, heads: int, *, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp_ratio * width)
        self.fc_out = nn.Linear(mlp_ratio * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.proj(self._attend(self.ln1(x))))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        n, t, width = x.shape
        # (N, T, 3W) -> 3 x (N, heads, T, W / heads)
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, width // self.heads).unbind(2)
        q, k, v = (part.transpose(1, 2) for part in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return y.transpose(1, 2).reshape(n, t, width)


def gpt(
    depth: int = 12,
    width: int = 768,
    heads: int = 12,
    vocab: int = 50257,
    seq_len: int = 1024,
    *,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    device: DeviceLike = None,
) -> nn.Sequential:
    """A GPT-2-style language model as ``depth + 3`` layers; the defaults are GPT-2 small.

    Args:
        depth: Number of transformer blocks.
        width: Model width (embedding size); must divide by ``heads``.
        heads: Attention heads per block.
        vocab: Vocabulary size (embedding rows and logits).
        seq_len: Longest sequence the position embedding covers.
        mlp_ratio: MLP hidden width as a multiple of ``width``.
        dropout: Dropout on the embedding, attention and residual branches.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model; token ids ``(N, T)`` with ``T <= seq_len`` -> logits ``(N, T, vocab)``.

    Example:
        >>> model = gpt(depth=2, width=32, heads=4, vocab=100, seq_len=16)
        >>> model(torch.randint(100, (2, 16))).shape
        torch.Size([2, 16, 100])
    """
    _validate(depth=depth, width=width, heads=heads, vocab=vocab, seq_len=seq_len)
    with on_device(device):
        blocks = [Block(width, heads, mlp_ratio=mlp_ratio, dropout=dropout) for _ in range(depth)]
        model = nn.Sequential(
            Embedding(vocab, width, seq_len, dropout=dropout),
            *blocks,
            nn.LayerNorm(width),
            nn.Linear(width, vocab, bias=False),
        )
        model.apply(_initialize)
    return model


def _validate(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int; pass e.g. {name}=8")
    if sizes["width"] % sizes["heads"]:
        raise ValueError(
            f"width={sizes['width']} does not divide by heads={sizes['heads']}; "
            f"pick a width that is a multiple of {sizes['heads']}"
        )


def _initialize(module: nn.Module) -> None:
    # GPT-2's recipe: N(0, 0.02) for weights and embeddings, zero biases.
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
