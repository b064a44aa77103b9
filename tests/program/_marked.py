"""A small transformer-like model whose forward calls torch.distributed.pipelining's
``pipe_split()`` before the blocks it names, as a torch pipelining user writes it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

VOCAB = 16


class Block(nn.Module):
    """Pre-norm residual block: attention-like mixing over positions, then an MLP."""

    def __init__(self, width: int, marker_inside: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.marker_inside = marker_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.mix(h).softmax(dim=-1) * h.cumsum(dim=1)  # mixes positions
        if self.marker_inside:
            pipe_split()  # inside a unit: pipepar cannot split here
        return x + self.mlp(x)


class Marked(nn.Module):
    """Embedding, ``depth`` blocks in a ModuleList, a norm and a head; ``pipe_split()`` is
    called before each block index in ``before`` (and, with ``first``/``last``, before the
    embedding or after the head)."""

    def __init__(
        self,
        before: Sequence[int] = (2,),
        *,
        depth: int = 4,
        width: int = 8,
        inside: int | None = None,
        first: bool = False,
        last: bool = False,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, k == inside) for k in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.before, self.first, self.last = list(before), first, last

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            pipe_split()
        x = self.emb(ids)
        for k, block in enumerate(self.blocks):
            for _ in range(self.before.count(k)):
                pipe_split()
            x = block(x)
        out = self.head(self.norm(x))
        if self.last:
            pipe_split()
        return out


def batch(rows: int = 4, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class Normed(nn.Module):
    """An input layer, ``depth`` blocks (linear, ReLU, batch norm, dropout) and a head on
    ``(rows, 4)`` inputs; ``pipe_split()`` before block ``at``. In training mode each block's
    batch norm needs more than one row and its dropout draws random numbers."""

    def __init__(self, at: int = 1, *, depth: int = 3, width: int = 6, p: float = 0.2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.BatchNorm1d(width), nn.Dropout(p))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)
        self.at = at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for k, block in enumerate(self.blocks):
            if k == self.at:
                pipe_split()
            x = block(x)
        return self.head(x)
