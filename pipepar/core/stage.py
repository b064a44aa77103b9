"""A stage: a contiguous run of layers placed on one device."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from pipepar.core.backward_plans import BackwardPlans
from pipepar.core.first_calls import FirstCalls
from pipepar.core.handed import handed
from pipepar.core.microbatch import Value, check_value, map_tensors

__all__ = ["Stage", "StageModule", "iter_layers", "split_stages"]


class StageModule(nn.Sequential):
    """The layers of one stage as a module: what runs when the stage runs, so hooks on it fire.

    It holds the same layer objects as the model, under their names in the model, and checks
    that every layer returns a tensor or a tuple of tensors.

    Example:
        >>> m = StageModule(OrderedDict(fc=nn.Linear(2, 2), act=nn.ReLU()), start=3)
        >>> m(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(self, layers: OrderedDict[str, nn.Module], *, start: int) -> None:
        super().__init__(layers)
        self.start = start

    def forward(self, input: Value) -> Value:
        value = input
        for offset, layer in enumerate(self):
            value = layer(value)
            if not isinstance(value, torch.Tensor):
                index = self.start + offset
                value = check_value(value, what=f"output of layer {index} ({type(layer).__name__})")
        return value


@dataclass
class Stage:
    """Layers ``start .. start+len(layers)-1`` of the model, on ``device``.

    Attributes:
        index: position of the stage in the pipeline (0-based).
        start: index in the model of the stage's first layer.
        layers: the stage's layers, the same module objects as in the model.
        device: where the layers' parameters live and where the stage computes.
        names: the layers' names in the model; default their indices (``str(start)``, ...).
        module: the layers as a :class:`StageModule`, the module that :meth:`run` calls.
        watch: what a new kind of input is watched under (a chain's
            :class:`~pipepar.core.first_calls.FirstCalls`); None: nothing.
        plans: the backward plans of the stage's graphs, kept from one mini-batch to the next
            (:func:`~pipepar.core.backward_plans.plans_over`); None until a backward plans.
    """

    index: int
    start: int
    layers: list[nn.Module]
    device: torch.device
    names: list[str] | None = None
    watch: FirstCalls | None = field(default=None, compare=False, repr=False)
    plans: BackwardPlans | None = field(default=None, init=False, compare=False, repr=False)
    in_place_first: bool = field(init=False)
    module: StageModule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.in_place_first = _starts_in_place(self.layers[0])
        names = (
            self.names
            if self.names is not None
            else [str(self.start + i) for i in range(len(self.layers))]
        )
        if len(names) != len(self.layers):
            raise ValueError(
                f"names has {len(names)} entries but the stage has {len(self.layers)} layers; "
                "pass one name per layer, or names=None for their indices"
            )
        self.names = list(names)
        self.module = StageModule(OrderedDict(zip(self.names, self.layers)), start=self.start)

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
        """Run the stage's layers on ``value`` through :attr:`module` (its hooks fire),
        checking every layer returns tensors."""
        return self.module(value)

    def protect(self, value: Value) -> Value:
        """What the layers are given of ``value``, the stage input the step keeps for backward
        (and for recompute): a copy if the first layer would overwrite it in place
        (``nn.ReLU(inplace=True)``; autograd refuses that on a leaf), else each tensor that
        takes a gradient as a view of it with a history (:mod:`pipepar.core.handed`)."""
        if self.in_place_first:
            return map_tensors(value, torch.Tensor.clone)
        return map_tensors(value, handed)

    def describe(self) -> str:
        """E.g. ``stage 1 (layers 3..5 on cpu)``."""
        return f"stage {self.index} (layers {self.start}..{self.stop - 1} on {self.device})"


def _starts_in_place(layer: nn.Module) -> bool:
    """True if the first module to touch the input (descending into containers) is in place."""
    while isinstance(layer, nn.Sequential) and len(layer) > 0:
        layer = layer[0]
    return bool(getattr(layer, "inplace", False))


def split_stages(
    layers: list[nn.Module],
    balance: list[int],
    devices: list[torch.device],
    names: list[str] | None = None,
) -> list[Stage]:
    """Cut ``layers`` into stages of ``balance`` sizes on ``devices`` (moving the layers there).

    ``names`` are the layers' names in the model (``[n for n, _ in model.named_children()]``),
    kept by each stage's :attr:`Stage.module`; default the layers' indices.
    """
    names = names if names is not None else [str(i) for i in range(len(layers))]
    if len(names) != len(layers):
        raise ValueError(
            f"names has {len(names)} entries but there are {len(layers)} layers; pass one name "
            "per layer, e.g. [n for n, _ in model.named_children()]"
        )
    stages, start = [], 0
    for j, (size, device) in enumerate(zip(balance, devices)):
        chunk = layers[start : start + size]
        for layer in chunk:
            layer.to(device)
        stages.append(Stage(j, start, chunk, device, names=names[start : start + size]))
        start += size
    return stages


def iter_layers(stages: list[Stage]) -> Iterator[nn.Module]:
    """All layers of all stages, in model order."""
    for stage in stages:
        yield from stage.layers
