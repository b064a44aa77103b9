"""Small random sequential models shared by the engine tests."""

from __future__ import annotations

import itertools
import random

import torch
from torch import nn

WIDTH = 12


def random_stack(rng: random.Random, n_layers: int, width: int = WIDTH) -> nn.Sequential:
    """A stack of width-preserving layers of assorted kinds (no randomness, no batch stats)."""
    makers = [
        lambda: nn.Linear(width, width),
        lambda: nn.Tanh(),
        lambda: nn.ReLU(),
        lambda: nn.LayerNorm(width),
        lambda: nn.GELU(),
        lambda: nn.Linear(width, width, bias=False),
    ]
    # the first layer is always a Linear so that every stack has parameters
    return nn.Sequential(makers[0](), *[rng.choice(makers)() for _ in range(n_layers - 1)])


def random_balance(rng: random.Random, n_layers: int, n_stages: int) -> list[int]:
    """A random split of n_layers into n_stages positive parts."""
    cuts = sorted(rng.sample(range(1, n_layers), n_stages - 1))
    bounds = [0, *cuts, n_layers]
    return [b - a for a, b in itertools.pairwise(bounds)]


def grads_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]
