"""Micro-batches of different rows and sequence lengths, and the plain model's losses over
them joined by hand: what the tests of ``pipe.step(microbatches=...)`` compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import transformers_zoo as zoo

__all__ = ["SHAPES", "chain", "chain_data", "hand_joined_lm", "lm_batches"]

SHAPES = [(3, 5), (1, 2), (2, 7)]
"""Rows and sequence length of each micro-batch."""


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def chain_data() -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(r, t, 4, generator=g) for r, t in SHAPES]
    ys = [torch.randn(r, t, 2, generator=g) for r, t in SHAPES]
    return xs, ys


def lm_batches(vocab: int = zoo.VOCAB) -> list[dict[str, Tensor]]:
    """Micro-batches of different rows and lengths, each with another count of ignored labels
    (the third has none to train on)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for (rows, seq), ignored in zip([(2, 7), (3, 4), (1, 9), (2, 3)], [3, 0, 5, 3]):
        ids = torch.randint(1, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        labels[:, :ignored] = -100
        out.append({"input_ids": ids, "labels": labels})
    out[2]["labels"][:] = -100
    return out


def hand_joined_lm(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """The token-mean cross-entropy over every micro-batch's real labels: their per-token
    losses summed over all micro-batches, divided by all counted tokens."""
    total, count = torch.zeros(()), 0
    for b in batches:
        logits = model(input_ids=b["input_ids"]).logits[:, :-1]
        labels = b["labels"][:, 1:]
        total = total + F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum"
        )
        count += int((labels != -100).sum())
    return total / count
