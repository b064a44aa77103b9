"""Small seeded models the planner and wrap tests build: an ``nn.Sequential`` and a model
that is not one."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Residual", "tanh_stack"]


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
