"""Training checkpoints of a pipe across ranks: saved sharded or in one file, loadable anywhere.

(Not to be confused with activation checkpointing, the ``checkpoint=`` option of ``wrap``.)

:func:`save_checkpoint` is called on every rank of the grid, for the pipe across ranks
(:class:`~pipepar.distributed.pipe.DistributedPipe`, of an ``nn.Sequential`` or any model); in
one process it also saves a
``pipepar.wrap`` pipe or the plain model. Two formats, told apart by the path:

- **A directory** (the default: any path not ending in ``.pt`` or ``.pth``), written with
  ``torch.distributed.checkpoint`` (:mod:`pipepar.persist.sharded`). The ranks of replica 0
  write in parallel, each the tensors its stage computes and their optimizer state, under the
  plain model's names (a weight tied across stages once, by the first stage using it; the
  other replicas hold the same values and write nothing). Nothing is gathered on one rank. The
  writers fill ``.<name>.tmp`` next to the directory; once DCP's last collective has seen all
  of them done, stage 0 renames it to ``<name>``: a crash mid-save leaves the previous
  checkpoint in place (:mod:`pipepar.persist.directories`). ``pipepar convert CKPT_DIR OUT.pt``
  turns it into one file of the format below. A pipe with ``dp_shard=True`` holds each
  parameter and its optimizer state in shards over its replicas: every rank of the grid then
  writes its shards (``DTensor``, which DCP saves in place), under the same keys.
- **One file** (``.pt``, ``.pth`` or ``sharded=False``): the stages of replica 0 gather their
  state onto stage 0 (shards are first gathered whole over their replicas), which writes it
  with :func:`pipepar.io.save` (atomic as well). A plain
  dict that ``torch.load(path, weights_only=True)`` reads::

    {"format": "pipepar/1", "model": <the whole model's state_dict, original keys>,
     "optimizer": {"state": {param name: state}, "param_groups": [{..., "params": [names]}]},
     "balance": [...], "dp": 2, "extra": {...}}

Optimizer state is keyed by parameter *name*, not by position
(:mod:`pipepar.persist.named_state`), so :func:`load_checkpoint` restores either format into
any split of the same model: another balance, stage count or ``dp``, a single-process
``pipepar.wrap`` pipe or the plain model (each with its own optimizer of the same kind). RNG
states are not saved: seed per step if a layer draws random numbers. Ranks wait for each other
on the pipe's process groups, so a save must end within the pipe's ``timeout``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor, nn

import pipepar.persist.files
from pipepar.distributed.pipe import DistributedPipe
from pipepar.persist import directories
from pipepar.persist import sharded as sharded_
from pipepar.persist.named_state import (
    grouped,
    load_named_optimizer_state,
    named_optimizer_state,
    parameter_names,
    per_parameter,
)
from pipepar.persist.outcome import NotSaved
from pipepar.program.rank_compute import RankProgram
from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.sharding import full_tensors, is_dtensor, shard_like, shard_state

__all__ = [
    "load_checkpoint",
    "load_named_optimizer_state",
    "named_optimizer_state",
    "save_checkpoint",
]

FORMAT = sharded_.FILE_FORMAT
PathLike = str | os.PathLike[str]
Writer = Callable[[str, nn.Module, torch.optim.Optimizer | None, dict[str, Any], Mesh | None], None]


# -- saving -------------------------------------------------------------------------------------
def save_checkpoint(
    path: PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    sharded: bool | None = None,
) -> None:
    """Write the whole model and its optimizer state to ``path``; call it on every rank.

    Args:
        path: the checkpoint directory (sharded), or a file ending in ``.pt``/``.pth``; on a
            file system every writing rank sees (a file: the grid's first rank).
        module: this rank's pipe (a ``DistributedPipe``), or, in
            one process, a ``pipepar.wrap`` pipe or the plain model.
        optimizer: the optimizer over ``module.parameters()``, or ``None`` for weights only.
        extra: small picklable values to keep alongside (step count, data position ...);
            plain types and tensors only, so that ``weights_only`` loading works.
        sharded: ``True`` for a directory, ``False`` for one file; ``None`` (default): one
            file if ``path`` ends in ``.pt`` or ``.pth``, else a directory.

    Raises:
        OSError: on the rank that could not write (the other ranks raise ``RuntimeError``
            with its message; the previous checkpoint is untouched and the pipe stays usable).
        ValueError: a directory is asked for where a file is (pass another path).
        PipelineError: on every rank when a rank fails while the state is gathered.

    Example:
        >>> save_checkpoint("run/last", pipe, opt, extra={"step": step})  # doctest: +SKIP
    """
    path = _check_path(path)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, but got {type(extra).__name__}")
    write = _write_sharded if _is_sharded(path, sharded) else _write_file
    if optimizer is not None:
        parameter_names(module, optimizer)  # the same user error on every rank, before any message
    if not isinstance(module, DistributedPipe):
        write(path, module, optimizer, dict(extra or {}), None)
        return
    outcome: list[BaseException | None] = [None]
    failure = module._guarded(
        lambda: _save(write, path, module, optimizer, dict(extra or {}), outcome)
    )
    if outcome[0] is not None:
        raise outcome[0]
    if failure is not None:
        raise RuntimeError(f"checkpoint {path} was not saved: {failure}")


def _save(
    write: Writer,
    path: str,
    pipe: DistributedPipe,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    outcome: list[BaseException | None],
) -> str | None:
    """Replica 0 writes (every replica, of shards); every rank learns how it went."""
    mesh, failure = pipe.mesh, None
    if mesh.where.replica == 0 or _sharded(pipe):
        try:
            write(path, pipe, optimizer, extra, mesh)
        except Exception as error:  # reported to every rank; the pipe stays usable
            outcome[0] = error
            failure = (
                error.reason
                if isinstance(error, NotSaved)
                else f"{mesh.where} could not write it: {type(error).__name__}: {error}"
            )
    return _announce(failure, mesh)


def _write_sharded(
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    mesh: Mesh | None,
) -> None:
    """This rank's share into the directory, with the other writers of its pipeline."""
    model, aliases = _share(module)
    sharded_.save(
        path,
        model,
        None if optimizer is None else _optimizer_share(module, optimizer, model),
        aliases=aliases,
        extra=extra,
        layout=_layout(module),
        group=None if mesh is None else _writers(module, mesh),
    )


def _sharded(module: nn.Module) -> TypeGuard[DistributedPipe]:
    """Whether ``module`` is a pipe holding shards (``dp_shard``): every replica then writes."""
    return isinstance(module, DistributedPipe) and module.dp_shard


def _writers(module: nn.Module, mesh: Mesh) -> dist.ProcessGroup | None:
    """The ranks writing a sharded checkpoint: replica 0's pipeline, or the grid's with shards."""
    if not _sharded(module):
        return mesh.ctl
    return module.group or dist.group.WORLD


def _write_file(
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    mesh: Mesh | None,
) -> None:
    """Gather the shares of the pipeline on its stage 0, which writes them (shards are first
    gathered whole, on every replica)."""
    model, aliases = _share(module)
    local = {
        "model": {k: v.detach().cpu() for k, v in full_tensors(model).items()},
        "aliases": aliases,
        "optimizer": None
        if optimizer is None
        else full_tensors(_optimizer_share(module, optimizer, model)),
    }
    if mesh is not None and mesh.where.replica != 0:
        return
    parts = [local] if mesh is None else _gather_on_first(local, mesh)
    if mesh is not None and mesh.stage != 0:
        return
    payload = _merge(parts, extra=extra, **_layout(module))
    if isinstance(module, DistributedPipe):
        payload["model"] = module.compute.in_model_order(payload["model"])
    pipepar.persist.files.save(payload, path)


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
    parts: list[dict[str, Any]], *, balance: list[int] | None, dp: int, extra: dict[str, Any]
) -> dict[str, Any]:
    model = {k: v for part in parts for k, v in part["model"].items()}
    for part in parts:  # a tied weight under each of its names, one tensor in the file
        model.update({alias: model[name] for alias, name in part["aliases"].items()})
    optimizer = None
    if parts[0]["optimizer"] is not None:
        per = {
            "state": {k: v for p in parts for k, v in p["optimizer"]["state"].items()},
            "param_groups": {
                k: v for p in parts for k, v in p["optimizer"]["param_groups"].items()
            },
        }
        optimizer = grouped(per)
    return {
        "format": FORMAT,
        "model": model,
        "optimizer": optimizer,
        "balance": balance,
        "dp": dp,
        "extra": extra,
    }


# -- what each rank writes ----------------------------------------------------------------------
def _entries(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``module``'s state_dict entries, each tensor once under its first name (a pipe across
    ranks: those it holds), and the other names of tied tensors -> the first."""
    first: dict[int, str] = {}
    entries: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            entries[name] = t
    return entries, aliases


def _share(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The entries this rank writes: none on replicas but the first (they hold the same
    values), but for their shards (``dp_shard``); of those, the ones its stages compute
    (``own_state`` of the pipe's compute, the rule ``full_state_dict`` follows too)."""
    entries, aliases = _entries(module)
    if isinstance(module, DistributedPipe) and module.mesh.where.replica != 0:
        if not _sharded(module):
            return {}, {}
        entries, aliases = {k: t for k, t in entries.items() if is_dtensor(t)}, {}
    if isinstance(module, DistributedPipe):  # each entry from the one stage computing it
        entries = module.compute.own_state(entries)
    return entries, aliases


def _optimizer_share(
    module: nn.Module, optimizer: torch.optim.Optimizer, model: Mapping[str, Tensor]
) -> dict[str, Any]:
    """The optimizer state of the parameters among ``model``, per parameter (CPU)."""
    per = per_parameter(named_optimizer_state(module, optimizer))
    return {part: {k: v for k, v in per[part].items() if k in model} for part in per}


def _layout(module: nn.Module) -> dict[str, Any]:
    if isinstance(module, DistributedPipe):
        return {"balance": list(module.balance), "dp": module.dp}
    return {"balance": None, "dp": 1}


# -- loading ------------------------------------------------------------------------------------
def load_checkpoint(
    path: PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` directory or file into ``module`` (and ``optimizer``);
    return ``extra``.

    ``module`` may be a pipe across ranks of any balance, stage count or ``dp`` (each rank
    reads only what it holds; call it on every rank, ``path`` readable by all), a
    ``pipepar.wrap`` pipe or the plain model. The optimizer must be of the same kind as the
    saved one, over ``module``'s parameters. A directory that an interrupted save left as
    ``.<name>.tmp`` is never read in place of ``<name>``; the previous checkpoint a save
    killed between its two renames left as ``.<name>.old`` is (with a warning).

    Args:
        path: the checkpoint directory, or a one-file checkpoint (``"pipepar/1"``, also what
            ``pipepar convert`` writes).
        module: where the weights go (keys as in the plain model).
        optimizer: where the optimizer state goes; ``None`` to load weights only.

    Returns:
        The ``extra`` dict the checkpoint was saved with (empty when none was given).

    Raises:
        FileNotFoundError: nothing at ``path`` (the message names what an interrupted save left).
        ValueError: when the checkpoint lacks optimizer state, or names parameters that differ.
        PipelineError: on every rank of a pipe across ranks when one rank cannot load.

    Example:
        >>> extra = load_checkpoint("run/last", pipe, opt)  # doctest: +SKIP
        >>> start = extra["step"] + 1  # doctest: +SKIP
    """
    path = _check_path(path)
    extra: dict[str, Any] = {}

    def load() -> None:
        sharded = directories.readable(Path(os.path.abspath(path))) is not None
        read = _read_sharded if sharded else _read_file
        extra.update(read(path, module, optimizer))

    if isinstance(module, DistributedPipe):
        module._guarded(load)
    else:
        load()
    return extra


def _read_sharded(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    entries, _ = _entries(module)
    names = None if optimizer is None else list(parameter_names(module, optimizer).values())
    state, extra = sharded_.load(path, entries, parameters=names)
    if optimizer is not None and state is not None:
        load_named_optimizer_state(module, optimizer, _as_held(module, state))
    return extra


def _read_file(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    if not os.path.isfile(path):
        left = directories.interrupted(Path(os.path.abspath(path)))
        hint = f" ({left})" if left else ""
        raise FileNotFoundError(f"no checkpoint at {path!r}{hint}; check the path on every rank")
    # mmap: each rank pages in only the tensors of its own stage
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a pipepar checkpoint (no format {FORMAT!r}); for a bare "
            "state_dict use module.load_state_dict(torch.load(path))"
        )
    _load_weights(module, checkpoint["model"], path)
    if optimizer is not None:
        saved = _as_held(module, _optimizer_part(checkpoint, path))
        load_named_optimizer_state(module, optimizer, saved)
    return dict(checkpoint.get("extra") or {})


def _as_held(module: nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """Saved (whole) optimizer state as ``module`` holds it: shards where it holds shards."""
    return shard_state(saved, dict(module.named_parameters())) if _sharded(module) else saved


def _load_weights(module: nn.Module, model: Mapping[str, Tensor], path: str) -> None:
    if not (isinstance(module, DistributedPipe) and isinstance(module.compute, RankProgram)):
        module.load_state_dict(model)
        return
    # its state_dict() holds only this rank's tensors (or their shards): fill those in place
    for name, t in _entries(module)[0].items():
        if name not in model:
            raise ValueError(
                f"{path} has no entry for {name!r}; load a checkpoint of the same model"
            )
        t.detach().copy_(shard_like(model[name], t))


def _optimizer_part(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    if checkpoint.get("optimizer") is None:
        raise ValueError(
            f"{path} holds no optimizer state (it was saved with optimizer=None); pass "
            "optimizer=None to load the weights only"
        )
    return checkpoint["optimizer"]


def _is_sharded(path: str, sharded: object) -> bool:
    """By the name alone, so that every rank decides alike whatever its file system holds."""
    if sharded is None:
        return not path.lower().endswith((".pt", ".pth"))
    if not isinstance(sharded, bool):
        raise TypeError(f"sharded must be True, False or None, but got {sharded!r}")
    return sharded


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, but got {type(path).__name__}")
    return os.fspath(path)
