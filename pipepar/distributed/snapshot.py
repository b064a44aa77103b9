"""Training checkpoints of a pp x dp pipeline: one file, written atomically, loadable anywhere.

(Not to be confused with activation checkpointing, the ``checkpoint=`` option of ``wrap``.)

:func:`save_checkpoint` is called on every rank of the grid. The stages of replica 0 gather
their layers' state and their optimizer's state onto stage 0, which writes one file with
:func:`pipepar.io.save` (a temporary file in the same folder, flushed to disk, then renamed over
``path``: a crash mid-write leaves the previous checkpoint intact). Every rank returns once the
file is in place. The file is a plain dict that ``torch.load(path, weights_only=True)`` reads::

    {"format": "pipepar/1", "model": <the whole model's state_dict, original keys>,
     "optimizer": {"state": {param name: state}, "param_groups": [{..., "params": [names]}]},
     "balance": [...], "dp": 2, "extra": {...}}

Optimizer state is keyed by parameter *name*, not by position, so :func:`load_checkpoint`
restores it into any split of the same model: another balance or stage count, a
single-process ``pipepar.wrap`` pipe or the plain model (each with its own optimizer of the
same kind). RNG states are not saved: seed per step if a layer draws random numbers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import pipepar.persist.files
from pipepar.distributed.pipe import DistributedPipe
from pipepar.distributed.stage import in_model_order
from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh

__all__ = [
    "load_checkpoint",
    "load_named_optimizer_state",
    "named_optimizer_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT = "pipepar/1"
PathLike = str | os.PathLike[str]


# -- saving -------------------------------------------------------------------------------------
def save_checkpoint(
    path: PathLike,
    pipe: DistributedPipe,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the whole model and its optimizer state to ``path``; call it on every rank.

    Args:
        path: the file to (over)write, on the filesystem of the grid's first rank.
        pipe: this rank's pipeline.
        optimizer: the optimizer over ``pipe.parameters()``, or ``None`` for weights only.
        extra: small picklable values to keep alongside (step count, data position ...);
            plain types and tensors only, so that ``weights_only`` loading works.

    Raises:
        OSError: on the writing rank when the file cannot be written (the other ranks raise
            ``RuntimeError`` with its message; the previous file is untouched and the pipe
            stays usable).
        PipelineError: on every rank when a rank fails while the state is gathered.

    Example:
        >>> save_checkpoint("run/last.pt", pipe, opt, extra={"step": step})  # doctest: +SKIP
    """
    path = _check_path(path)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, but got {type(extra).__name__}")
    if optimizer is not None:
        _names_of(pipe, optimizer)  # the same user error on every rank, before any message
    outcome: list[BaseException | None] = [None]
    failure = pipe._guard(lambda: _save(path, pipe, optimizer, dict(extra or {}), outcome))
    if outcome[0] is not None:
        raise outcome[0]
    if failure is not None:
        raise RuntimeError(f"checkpoint {path} was not saved: {failure}")


def _save(
    path: str,
    pipe: DistributedPipe,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    outcome: list[BaseException | None],
) -> str | None:
    """Gather on replica 0, write on its stage 0, tell every rank how it went."""
    mesh, failure = pipe.mesh, None
    if mesh.where.replica == 0:
        local = {
            "model": {k: v.detach().cpu() for k, v in pipe.state_dict().items()},
            "optimizer": None if optimizer is None else named_optimizer_state(pipe, optimizer),
        }
        parts = _gather_on_first(local, mesh)
        if mesh.stage == 0:
            payload = _merge(parts, balance=pipe.balance, dp=pipe.dp, extra=extra)
            payload["model"] = in_model_order(payload["model"], pipe.layer_names)
            try:
                pipepar.io.save(payload, path)
            except Exception as error:  # reported to every rank; the pipe stays usable
                outcome[0] = error
                failure = f"{mesh.where} could not write it: {type(error).__name__}: {error}"
    return _announce(failure, mesh)


def _gather_on_first(local: dict[str, Any], mesh: Mesh) -> list[dict[str, Any]]:
    if mesh.ctl is None:
        return [local]
    parts: list[Any] = [None] * mesh.pp if mesh.stage == 0 else []
    with comm(f"gathering the checkpoint over ranks {mesh.pipeline_ranks}"):
        dist.gather_object(
            local, parts if mesh.stage == 0 else None, dst=mesh.pipeline_ranks[0], group=mesh.ctl
        )
    return parts


def _announce(failure: str | None, mesh: Mesh) -> str | None:
    """Broadcast the writer's outcome: to the stage-0 ranks, then along every pipeline."""
    message: list[Any] = [failure]
    with comm("announcing the saved checkpoint"):
        if mesh.dp_group is not None and mesh.stage == 0:
            dist.broadcast_object_list(message, src=mesh.replica_ranks[0], group=mesh.dp_group)
        if mesh.ctl is not None:
            dist.broadcast_object_list(message, src=mesh.pipeline_ranks[0], group=mesh.ctl)
    return message[0]


def _merge(
    parts: list[dict[str, Any]], *, balance: list[int], dp: int, extra: dict[str, Any]
) -> dict[str, Any]:
    model = {k: v for part in parts for k, v in part["model"].items()}
    optimizer = None
    if parts[0]["optimizer"] is not None:
        optimizer = {
            "state": {k: v for p in parts for k, v in p["optimizer"]["state"].items()},
            "param_groups": _merge_groups(
                [g for p in parts for g in p["optimizer"]["param_groups"]]
            ),
        }
    return {
        "format": FORMAT,
        "model": model,
        "optimizer": optimizer,
        "balance": list(balance),
        "dp": dp,
        "extra": extra,
    }


def _merge_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One group per distinct set of hyperparameters: each stage had its own copy of each."""
    merged: list[dict[str, Any]] = []
    for group in groups:
        same = next((m for m in merged if _same_hyperparameters(m, group)), None)
        if same is None:
            merged.append({**group, "params": list(group["params"])})
        else:
            same["params"] += group["params"]
    return merged


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


# -- loading ------------------------------------------------------------------------------------
def load_checkpoint(
    path: PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file into ``module`` (and ``optimizer``); return ``extra``.

    ``module`` may be a :class:`DistributedPipe` (each rank loads its own layers; call it on
    every rank, ``path`` readable by all), a ``pipepar.wrap`` pipe or the plain model, with any
    balance. The optimizer must be of the same kind as the saved one, over ``module``'s
    parameters.

    Args:
        path: the checkpoint file.
        module: where the weights go (keys as in the plain model).
        optimizer: where the optimizer state goes; ``None`` to load weights only.

    Raises:
        ValueError: when the file lacks optimizer state, or names parameters that differ.
        PipelineError: on every rank of a DistributedPipe when one rank cannot load.

    Example:
        >>> extra = load_checkpoint("run/last.pt", pipe, opt)  # doctest: +SKIP
        >>> start = extra["step"] + 1  # doctest: +SKIP
    """
    path = _check_path(path)
    extra: dict[str, Any] = {}

    def load() -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}; check the path on every rank")
        # mmap: each rank pages in only the tensors of its own stage
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not a pipepar checkpoint (no format {FORMAT!r}); for a bare "
                "state_dict use module.load_state_dict(torch.load(path))"
            )
        module.load_state_dict(checkpoint["model"])
        if optimizer is not None:
            load_named_optimizer_state(module, optimizer, _optimizer_part(checkpoint, path))
        extra.update(checkpoint.get("extra") or {})

    if isinstance(module, DistributedPipe):
        module._guard(load)
    else:
        load()
    return extra


def _optimizer_part(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    if checkpoint.get("optimizer") is None:
        raise ValueError(
            f"{path} holds no optimizer state (it was saved with optimizer=None); pass "
            "optimizer=None to load the weights only"
        )
    return checkpoint["optimizer"]


# -- optimizer state by parameter name ---------------------------------------------------------
def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by ``module``'s parameter names (CPU tensors).

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # doctest: +SKIP
        >>> named_optimizer_state(model, opt)["param_groups"][0]["params"][:2]  # doctest: +SKIP
        ['0.weight', '0.bias']
    """
    names = _names_of(module, optimizer)
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
    names = _names_of(module, optimizer)
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


def _names_of(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Position in ``optimizer.state_dict()`` -> parameter name in ``module``."""
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


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, but got {type(path).__name__}")
    return os.fspath(path)


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
