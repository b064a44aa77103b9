"""What the sharded data-parallel tests share: relative errors, shards' local tensors, and
counting the collectives a step calls."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["Count", "local", "relative"]


def relative(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Count:
    """Calls of a torch.distributed collective, counted while installed."""

    def __init__(self, name: str) -> None:
        self.name, self.calls, self.real = name, 0, getattr(dist, name)

    def __enter__(self) -> Count:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.real(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(dist, self.name, self.real)
