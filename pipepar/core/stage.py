"""A stage: a contiguous run of layers placed on one device."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from pipepar.core.microbatch import Value, check_value, map_tensors

__all__ = ["Stage", "split_stages"]


@dataclass
class Stage:
    """Layers ``start .. start+len(layers)-1`` of the model, on ``device``.

    Attributes:
        index: position of the stage in the pipeline (0-based).
        start: index in the model of the stage's first layer.
        layers: the stage's layers, the same module objects as in the model.
        device: where the layers' parameters live and where the stage computes.
    """

    index: int
    start: int
    layers: list[nn.Module]
    device: torch.device
    in_place_first: bool = field(init=False)

    def __post_init__(self) -> None:
        self.in_place_first = _starts_in_place(self.layers[0])

    @property
    def stop(self) -> int:
        """Index in the model one past the stage's last layer."""
        return self.start + len(self.layers)

    def trainable(self) -> list[nn.Parameter]:
        """Parameters of the stage that require grad, each once."""
        seen: dict[int, nn.Parameter] = {}
        for layer in self.layers:
            for p in layer.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def run(self, value: Value) -> Value:
        """Run the stage's layers on ``value``, checking every layer returns tensors."""
        for offset, layer in enumerate(self.layers):
            value = layer(value)
            if not isinstance(value, torch.Tensor):
                index = self.start + offset
                value = check_value(value, what=f"output of layer {index} ({type(layer).__name__})")
        return value

    def protect(self, value: Value) -> Value:
        """A copy of ``value`` if the first layer would overwrite it in place.

        The stage input is kept for backward (and for recompute), and an in-place first layer
        such as ``nn.ReLU(inplace=True)`` would overwrite it; autograd refuses that on a leaf.
        """
        return map_tensors(value, torch.Tensor.clone) if self.in_place_first else value

    def describe(self) -> str:
        """E.g. ``stage 1 (layers 3..5 on cpu)``."""
        return f"stage {self.index} (layers {self.start}..{self.stop - 1} on {self.device})"


def _starts_in_place(layer: nn.Module) -> bool:
    """True if the first module to touch the input (descending into containers) is in place."""
    while isinstance(layer, nn.Sequential) and len(layer) > 0:
        layer = layer[0]
    return bool(getattr(layer, "inplace", False))


def split_stages(
    layers: list[nn.Module], balance: list[int], devices: list[torch.device]
) -> list[Stage]:
    """Cut ``layers`` into stages of ``balance`` sizes on ``devices`` (moving the layers there)."""
    stages, start = [], 0
    for j, (size, device) in enumerate(zip(balance, devices)):
        chunk = layers[start : start + size]
        for layer in chunk:
            layer.to(device)
        stages.append(Stage(j, start, chunk, device))
        start += size
    return stages


def iter_layers(stages: list[Stage]) -> Iterator[nn.Module]:
    """All layers of all stages, in model order."""
    for stage in stages:
        yield from stage.layers
