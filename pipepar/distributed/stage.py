"""Build this rank's stage: keep only the local layers and give them real memory.

The model may be built on the meta device (``with torch.device("meta"): model = ...``), so the
whole model never exists anywhere: each rank allocates its own layers with ``to_empty`` and
initialises them with ``reset_parameters()``, or loads them from a state_dict. A real model
works too; its local layers move to the rank's device and the other layers are left alone.

The stage is an ``nn.Sequential`` whose children keep their names in the original model, so its
``state_dict()`` keys are the original keys (``"3.weight"``, not ``"0.weight"``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

__all__ = ["build_stage", "in_model_order", "layer_range", "load_local_state", "materialize"]

T = TypeVar("T")


def layer_range(balance: Sequence[int], stage: int) -> range:
    """Indices of the layers that stage ``stage`` runs.

    Example:
        >>> layer_range([3, 3, 2], 1)
        range(3, 6)
    """
    start = sum(balance[:stage])
    return range(start, start + balance[stage])


def build_stage(
    model: nn.Sequential,
    balance: Sequence[int],
    stage: int,
    *,
    device: torch.device,
    state_dict: Mapping[str, Tensor] | None = None,
) -> nn.Sequential:
    """The layers of stage ``stage`` under their original names, materialized on ``device``.

    Args:
        model: the whole model, real or on the meta device.
        balance: layers per stage.
        stage: which stage this rank runs.
        device: where the local layers live.
        state_dict: weights to load, keyed like ``model.state_dict()``; other stages' keys are
            ignored, so the whole model's state_dict can be passed on every rank.

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> build_stage(model, [2, 1], 1, device=torch.device("cpu"))
        Sequential(
          (2): Linear(in_features=2, out_features=2, bias=True)
        )
    """
    names = list(model._modules)
    local = OrderedDict((names[i], model[i]) for i in layer_range(balance, stage))
    part = nn.Sequential(local)
    for name, layer in local.items():
        materialize(layer, device, name=name, loading=state_dict is not None)
    if state_dict is not None:
        load_local_state(part, state_dict)
    return part


def materialize(layer: nn.Module, device: torch.device, *, name: str, loading: bool) -> None:
    """Move ``layer`` to ``device``; allocate and initialise it there if it is on meta.

    Args:
        layer: one layer of the model.
        device: target device.
        name: the layer's name in the model, for error messages.
        loading: True when a state_dict will overwrite the parameters afterwards, so layers
            without ``reset_parameters()`` are fine.
    """
    if not any(t.is_meta for t in _tensors(layer)):
        layer.to(device)
        return
    uninitialisable = [
        type(sub).__name__
        for sub in layer.modules()
        if _own_tensors(sub) and not callable(getattr(sub, "reset_parameters", None))
    ]
    if uninitialisable and not loading:
        raise ValueError(
            f"layer {name} is on the meta device and its sub-module(s) {uninitialisable} have "
            "tensors but no reset_parameters(); pass state_dict=... to load real weights, or "
            "give those modules a reset_parameters() method"
        )
    layer.to_empty(device=device)
    with torch.no_grad():
        for sub in layer.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()


def load_local_state(part: nn.Sequential, state_dict: Mapping[str, Tensor]) -> None:
    """Load the entries of a whole-model ``state_dict`` that belong to the layers of ``part``.

    Raises:
        ValueError: if a local key is missing, naming the missing keys.
    """
    local = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in part._modules}
    missing = [k for k in part.state_dict() if k not in local]
    if missing:
        raise ValueError(
            f"state_dict lacks {len(missing)} key(s) of this stage, e.g. {missing[:3]}; pass the "
            "whole model's state_dict (keys like model.state_dict()) or this stage's"
        )
    part.load_state_dict(local, strict=True)


def in_model_order(state: Mapping[str, T], layer_names: Sequence[str]) -> dict[str, T]:
    """``state`` (keys like ``"3.weight"``) ordered by layer as in the model, each layer's keys
    in their own order: parts gathered rank by rank are not in layer order when ranks hold
    several stages.

    Example:
        >>> list(in_model_order({"2.w": 0, "0.w": 1, "0.b": 2}, ["0", "1", "2"]))
        ['0.w', '0.b', '2.w']
    """
    position = {name: k for k, name in enumerate(layer_names)}
    return dict(sorted(state.items(), key=lambda item: position[item[0].split(".", 1)[0]]))


def _tensors(layer: nn.Module) -> list[Tensor]:
    return list(layer.parameters()) + list(layer.buffers())


def _own_tensors(module: nn.Module) -> bool:
    direct = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return bool(direct)
