"""Optimizer state keyed by parameter *name*: what lets a checkpoint load into any split.

``optimizer.state_dict()`` numbers parameters by their position in the optimizer's groups, so
it only loads into an optimizer built over the same parameters in the same order. Keyed by the
parameter's name in the model instead, the state of a whole model can be cut into any stages
(another balance, another number of ranks, the plain model) and each part loaded into the
optimizer of the modules that hold those parameters. Two shapes of it:

- *grouped* (:func:`named_optimizer_state`): ``{"state": {name: {...}}, "param_groups":
  [{..., "params": [names]}]}``, as in the one-file checkpoint;
- *per parameter* (:func:`per_parameter`): ``{"state": {name: {...}}, "param_groups": {name:
  {"lr": ..., ...}}}``, each parameter with its own group's hyperparameters, which a rank can
  write without knowing the other ranks' parameters (the sharded checkpoint).

This module knows nothing of pipes, ranks or files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "grouped",
    "load_named_optimizer_state",
    "merge_groups",
    "named_optimizer_state",
    "parameter_names",
    "per_parameter",
]


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by ``module``'s parameter names (CPU tensors).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> named_optimizer_state(model, opt)["param_groups"][0]["params"]
        ['0.weight', '0.bias']
    """
    names = parameter_names(module, optimizer)
    saved = optimizer.state_dict()
    return {
        "state": {names[k]: _to_cpu(v) for k, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[k] for k in g["params"]]} for g in saved["param_groups"]
        ],
    }


def load_named_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> None:
    """Load what :func:`named_optimizer_state` returned, for ``module``'s parameters only.

    Each of the optimizer's groups takes its hyperparameters (``lr`` ...) from the saved group
    that held its parameters; entries of parameters that ``module`` lacks are ignored.

    Example:
        >>> saved = torch.load("ckpt.pt")["optimizer"]  # doctest: +SKIP
        >>> load_named_optimizer_state(pipe, opt, saved)  # doctest: +SKIP
    """
    names = parameter_names(module, optimizer)
    group_of = {name: g for g in saved["param_groups"] for name in g["params"]}
    state: dict[int, Any] = {}
    groups = []
    for k, group in enumerate(optimizer.state_dict()["param_groups"]):
        mine = [names[i] for i in group["params"]]
        source = _saved_group(mine, group_of, k)
        for i, name in zip(group["params"], mine, strict=True):
            if name in saved["state"]:
                state[i] = _clone(saved["state"][name])
        hyper = {h: v for h, v in source.items() if h != "params"}
        groups.append({**hyper, "params": group["params"]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def per_parameter(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The grouped named state as per-parameter state: each parameter's hyperparameters.

    Example:
        >>> saved = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
        >>> per_parameter(saved)["param_groups"]
        {'w': {'lr': 0.1}, 'b': {'lr': 0.1}}
    """
    hyper = {
        name: {h: v for h, v in g.items() if h != "params"}
        for g in saved["param_groups"]
        for name in g["params"]
    }
    return {"state": dict(saved["state"]), "param_groups": hyper}


def grouped(per: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`per_parameter`: parameters with equal hyperparameters share a group.

    Example:
        >>> grouped({"state": {}, "param_groups": {"w": {"lr": 0.1}, "b": {"lr": 0.1}}})
        {'state': {}, 'param_groups': [{'lr': 0.1, 'params': ['w', 'b']}]}
    """
    groups = [{**hyper, "params": [name]} for name, hyper in per["param_groups"].items()]
    return {"state": dict(per.get("state", {})), "param_groups": merge_groups(groups)}


def merge_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One group per distinct set of hyperparameters (each stage had its own copy of each)."""
    merged: list[dict[str, Any]] = []
    for group in groups:
        same = next((m for m in merged if _same_hyperparameters(m, group)), None)
        if same is None:
            merged.append({**group, "params": list(group["params"])})
        else:
            same["params"] += group["params"]
    return merged


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Position in ``optimizer.state_dict()`` -> parameter name in ``module``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: the optimizer holds parameters that are not ``module``'s.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, but got {type(optimizer).__name__}"
        )
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    strangers = [tuple(p.shape) for p in params if id(p) not in by_id]
    if strangers:
        raise ValueError(
            f"the optimizer holds {len(strangers)} parameter(s) (shapes {strangers[:3]}) that "
            f"are not {type(module).__name__}'s; build it over this module's parameters()"
        )
    return {k: by_id[id(p)] for k, p in enumerate(params)}


def _saved_group(mine: list[str], group_of: dict[str, Any], k: int) -> dict[str, Any]:
    missing = [n for n in mine if n not in group_of]
    if missing:
        raise ValueError(
            f"the saved optimizer state has no entry for parameter(s) {missing[:3]} of group "
            f"{k}; load a checkpoint of the same model, or pass optimizer=None"
        )
    sources = list({id(group_of[n]): group_of[n] for n in mine}.values())
    if any(not _same_hyperparameters(sources[0], other) for other in sources[1:]):
        raise ValueError(
            f"optimizer group {k} holds parameters that were in {len(sources)} saved groups "
            "with different hyperparameters; build the optimizer's groups as when the "
            "checkpoint was saved"
        )
    return sources[0] if sources else {}


def _same_hyperparameters(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = set(a) - {"params"}
    if keys != set(b) - {"params"}:
        return False
    for key in keys:
        x, y = a[key], b[key]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value
