"""Small seeded models the planner and wrap tests build: an ``nn.Sequential``, a model
that is not one, and one whose ends share a weight."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Residual", "TiedEnds", "tanh_stack"]


def tanh_stack(width: int) -> nn.Sequential:
    """Four ``Linear(width, width)`` + ``Tanh`` pairs: 8 layers, seeded."""
    torch.manual_seed(1)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())])


class Residual(nn.Module):
    """Not an ``nn.Sequential``: four residual blocks and a head (5 units), seeded."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class TiedEnds(nn.Module):
    """An embedding and a head sharing one weight (16 tokens, width 8), ``blocks`` blocks
    between them."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)
