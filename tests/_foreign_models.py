"""Small models written as their authors write them, without pipepar in mind: a nanoGPT-style
language model with its own loss under ``targets=``, one keeping a key cache its blocks append
to, and CLIP-like contrastive models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CachedLM",
    "Contrastive",
    "NanoGPT",
    "PairLogits",
    "Towers",
    "contrastive_loss",
    "nano_batch",
]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


class NanoGPT(nn.Module):
    """``forward(idx, targets)`` returns ``(logits, loss)``, the loss a cross-entropy with
    ``ignore_index=-1`` over the flattened tokens, as nanoGPT computes it."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 16)
        self.h = nn.ModuleList(_Block() for _ in range(layers))
        self.lm_head = nn.Linear(16, 11)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.size(-1))
        return logits, F.cross_entropy(flat, targets.view(-1), ignore_index=-1)


def nano_batch(rows: int = 8) -> tuple[Tensor, Tensor]:
    """Token ids and targets, unevenly padded with -1 (micro-batches hold different counts)."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 11, (rows, 6), generator=g)
    targets = torch.randint(0, 11, (rows, 6), generator=g)
    targets[:3, 2:], targets[5] = -1, -1
    return idx, targets


class _CachedBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.pos = nn.Embedding(32, 16)
        self.key = nn.Linear(16, 16)

    def forward(self, x: Tensor, cache: dict[int, Tensor]) -> Tensor:
        past = cache.get(self.index)
        start = 0 if past is None else past.shape[1]  # positions go on after the cached ones
        k = self.key(x + self.pos(torch.arange(start, start + x.shape[1])))
        cache[self.index] = k if past is None else torch.cat([past, k], 1)
        return x + torch.tanh(k)


class CachedLM(nn.Module):
    """Blocks that append their keys to a cache (a dict the forward makes) and number their
    positions after what it holds, as a language model with a key-value cache does."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 16)
        self.h = nn.ModuleList(_CachedBlock(i) for i in range(layers))
        self.head = nn.Linear(16, 11)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x, cache = self.wte(idx), {}
        for block in self.h:
            x = block(x, cache)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(), ignore_index=-1)


class Contrastive(nn.Module):
    """CLIP-like: two towers, logits between every image and every text of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.text = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, images: Tensor, texts: Tensor) -> Tensor:
        for layer in self.image:
            images = torch.tanh(layer(images))
        for layer in self.text:
            texts = torch.tanh(layer(texts))
        logits = F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).t()
        labels = torch.arange(len(logits))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class Towers(nn.Module):
    """:class:`Contrastive` without its loss: the two towers' embeddings, per row."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.text = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        for layer in self.image:
            images = torch.tanh(layer(images))
        for layer in self.text:
            texts = torch.tanh(layer(texts))
        return F.normalize(images, dim=-1), F.normalize(texts, dim=-1)


class PairLogits(nn.Module):
    """CLIP's logits without its loss: every image of the batch against every text."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.text = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, images: Tensor, texts: Tensor) -> Tensor:
        return self.image(images) @ self.text(texts).t()


def contrastive_loss(images: Tensor, texts: Tensor) -> Tensor:
    """CLIP's symmetric cross-entropy over every image-text pair of the batch."""
    logits = images @ texts.t()
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
