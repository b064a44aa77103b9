"""Sharded training checkpoints: one directory that every process holding a part writes in
parallel, through ``torch.distributed.checkpoint`` (DCP); nothing is gathered on one process.

The directory is DCP's own (``FileSystemWriter``: a ``.metadata`` file and one ``.distcp`` file
per writing process). Its keys, as DCP flattens the nested dict this module saves::

    model.<name>                            each tensor of the plain model's state_dict, written
                                            once: a tied weight under its first name only
    optimizer.state.<param>.<key>           the optimizer's state of a parameter (exp_avg, ...)
    optimizer.param_groups.<param>.<hyper>  the hyperparameters of that parameter's group (lr, ...)
    pipepar.format                          "pipepar/dcp/1"
    pipepar.aliases.<name>                  for a tied weight's other names: its first name
    pipepar.extra, pipepar.balance, ...     the caller's extra values; the layout that saved it

Every key names a parameter or buffer of the plain model, never a rank or a stage, so a
checkpoint loads into any split of the model (:func:`load`: each process reads only the
entries it asks for). It appears atomically (:mod:`pipepar.persist.directories`): writers fill
``.<name>.tmp``, and once DCP's last collective has seen every writer done, the first process of
the group renames it to ``<name>``.

For one file, :func:`to_single_file` (``pipepar convert CKPT_DIR OUT.pt``) writes the one-file
format ``"pipepar/1"``, which ``torch.load(out, weights_only=True)`` reads; torch's own
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` gives the nested dict as saved.
Loading unpickles the non-tensor entries (hyperparameters, ``extra``) without ``weights_only``:
load sharded checkpoints you trust only, or convert them where they were written.

This module knows nothing of pipes: its callers say what each process writes and reads.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import pipepar.persist.files
from pipepar.persist import directories, outcome
from pipepar.persist.named_state import grouped

__all__ = ["FILE_FORMAT", "FORMAT", "load", "save", "to_single_file"]

FORMAT = "pipepar/dcp/1"
"""The ``pipepar.format`` entry of a sharded checkpoint."""
FILE_FORMAT = "pipepar/1"
"""The ``"format"`` entry of a one-file checkpoint (also written by ``save_checkpoint``)."""

PathLike = str | os.PathLike[str]


NestedPath = tuple[str | int, ...]  # where a value sits in the nested dict saved
T = TypeVar("T")


# -- saving -------------------------------------------------------------------------------------
def save(
    path: PathLike,
    model: Mapping[str, Tensor],
    optimizer: Mapping[str, Any] | None = None,
    *,
    aliases: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    fsync: bool = True,
) -> None:
    """Write this process's part of a checkpoint; every process of ``group`` calls it.

    The parts must not overlap: each tensor is written by the one process that passes it.

    Args:
        path: the checkpoint directory, replaced atomically (on a file system every process
            of ``group`` sees).
        model: tensors of the plain model's ``state_dict`` under its keys (each once).
        optimizer: the optimizer state of those parameters, per parameter
            (:func:`~pipepar.persist.named_state.per_parameter`), or ``None``.
        aliases: other names of tied tensors -> the name they are saved under.
        extra: small values to keep (step count, data position ...), the same on every process.
        layout: how the model was split when saved (``balance``, ``dp``), for information.
        group: the writing processes; ``None``: this process alone.
        fsync: flush every file to the disk (off only for throwaway checkpoints).

    Raises:
        ValueError: ``path`` is a file.
        OSError: on a process that could not write; the others raise
            :class:`~pipepar.persist.outcome.NotSaved` naming it. ``path`` is then as it was.

    Example:
        >>> save("run/ckpt", model.state_dict())  # doctest: +SKIP
    """
    target = _check_path(path)
    first = group is None or dist.get_rank(group) == 0
    staged = directories.staging_path(target)
    # the first process empties the staging directory before anyone writes into it
    stage = functools.partial(directories.staging, target)
    outcome.together(stage if first else None, group, target)
    state = _nested(model, optimizer, aliases, extra, layout)
    writer = dcp.FileSystemWriter(staged, sync_files=fsync)
    alone = group is None
    try:
        _quiet(lambda: dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone))
    except CheckpointException as error:  # raised on every process alike
        if first:
            directories.discard(staged)
        raise outcome.from_dcp(error, group, target) from None
    # DCP's last collective has returned: every process wrote its files and the first the
    # metadata, so the staging directory is complete and may take the checkpoint's name.
    commit = functools.partial(directories.commit, staged, target, fsync=fsync)
    outcome.together(commit if first else None, group, target)


def _nested(
    model: Mapping[str, Tensor],
    optimizer: Mapping[str, Any] | None,
    aliases: Mapping[str, str] | None,
    extra: Mapping[str, Any] | None,
    layout: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What DCP saves (and flattens to the keys of the module docstring)."""
    return {
        "model": {k: v.detach() for k, v in model.items()},
        "optimizer": {}
        if optimizer is None
        else {"state": dict(optimizer["state"]), "param_groups": dict(optimizer["param_groups"])},
        "pipepar": {
            "format": FORMAT,
            "aliases": dict(aliases or {}),
            "extra": (dict(extra or {}),),  # one value: its keys may hold dots
            **dict(layout or {}),
        },
    }


# -- loading ------------------------------------------------------------------------------------
def load(
    path: PathLike, model: Mapping[str, Tensor], *, parameters: Collection[str] | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Read the entries of ``model`` (in place) and the optimizer state of ``parameters``.

    This process reads only what it asks for, alone (no collective): each rank of a pipe
    calls it for its own stage's tensors.

    Args:
        path: a directory :func:`save` wrote.
        model: tensors to fill, by their names in the plain model (a tied weight under any of
            its names).
        parameters: names of the parameters whose optimizer state to read; ``None``: none.

    Returns:
        The optimizer state of ``parameters`` as
        :func:`~pipepar.persist.named_state.named_optimizer_state` returns it (``None`` when
        ``parameters`` is ``None``), and the ``extra`` values saved.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: it is not a complete sharded checkpoint, or lacks an entry asked for, or
            holds another shape of it.

    Example:
        >>> names = [n for n, _ in model.named_parameters()]  # doctest: +SKIP
        >>> state, extra = load("run/ckpt", model.state_dict(), parameters=names)  # doctest: +SKIP
    """
    source, metadata = _open(path)
    where = _paths(metadata)
    template: dict[str, Any] = {}
    saved = {str(p[1]): key for key, p in where.items() if p[0] == "model"}
    resolve = _resolver(source, metadata, where, saved)
    for name, tensor in model.items():
        key = resolve(name)
        _check_shape(metadata, key, name, tensor, source)
        template[key] = tensor.detach()
    wanted = set(parameters or ())
    optimizer = [k for k, p in where.items() if p[0] == "optimizer" and p[2] in wanted]
    if parameters is not None and not any(where[k][0] == "optimizer" for k in where):
        raise ValueError(
            f"{source} holds no optimizer state (it was saved with optimizer=None); pass "
            "optimizer=None to load the weights only"
        )
    ours = [k for k, p in where.items() if p[:2] in (("pipepar", "extra"), ("pipepar", "format"))]
    values = _read(source, metadata, template, optimizer + ours)
    nested = _nest({where[k]: v for k, v in values.items() if k not in template})
    _check_format(nested, source)
    per = {"param_groups": {}, **nested.get("optimizer", {})}
    return (None if parameters is None else grouped(per)), _extra(nested)


def to_single_file(checkpoint: PathLike, out: PathLike, *, fsync: bool = True) -> Path:
    """Convert a sharded checkpoint into one ``"pipepar/1"`` file, in this process.

    The file is the dict ``{"format": "pipepar/1", "model": state_dict, "optimizer": {"state":
    {name: ...}, "param_groups": [{..., "params": [names]}]} or None, "extra": {...},
    "balance": ..., "dp": ...}``: ``model`` is the plain model's ``state_dict`` (tied weights
    under every name), loadable with ``model.load_state_dict(torch.load(out)["model"])``, and
    the whole file with ``pipepar.distributed.load_checkpoint`` into any split. The whole model
    is in memory once. The file is written atomically (:func:`pipepar.persist.files.save`).

    Example:
        >>> to_single_file("run/ckpt", "run/ckpt.pt")  # doctest: +SKIP
        PosixPath('run/ckpt.pt')
    """
    source, metadata = _open(checkpoint)
    where = _paths(metadata)
    nested = _nest({where[k]: v for k, v in _read(source, metadata, {}, list(where)).items()})
    _check_format(nested, source)
    model = dict(nested.get("model", {}))
    for alias, name in nested["pipepar"].get("aliases", {}).items():
        model[alias] = model[name]
    per = nested.get("optimizer")
    payload = {
        "format": FILE_FORMAT,
        "model": model,
        "optimizer": grouped({"param_groups": {}, **per}) if per else None,
        "balance": nested["pipepar"].get("balance"),
        "dp": nested["pipepar"].get("dp"),
        "extra": _extra(nested),
    }
    return pipepar.persist.files.save(payload, out, fsync=fsync)


def _open(path: PathLike) -> tuple[Path, Metadata]:
    asked = _check_path(path)
    source = directories.readable(asked)
    if source is None:
        left = directories.interrupted(asked)
        raise FileNotFoundError(
            f"no checkpoint directory at {str(path)!r}{f' ({left})' if left else ''}; check "
            "the path, or start without resuming"
        )
    try:
        metadata = dcp.FileSystemReader(source).read_metadata()
    except FileNotFoundError:
        raise ValueError(
            f"{str(path)!r} holds no checkpoint metadata: it is not a sharded checkpoint, or "
            "one whose save did not finish; pass the directory save_checkpoint wrote"
        ) from None
    if "pipepar.format" not in metadata.state_dict_metadata:
        raise ValueError(
            f"{str(path)!r} is a torch.distributed.checkpoint directory but not pipepar's "
            f"(no pipepar.format); read it with torch.distributed.checkpoint.load"
        )
    return source, metadata


def _check_format(nested: Mapping[str, Any], source: Path) -> None:
    found = nested["pipepar"]["format"]
    if found != FORMAT:
        raise ValueError(
            f"{source} is a sharded checkpoint of format {found!r}, but this pipepar reads "
            f"{FORMAT!r}; load it with the pipepar version that saved it"
        )


def _paths(metadata: Metadata) -> dict[str, NestedPath]:
    """Flat key -> its path in the nested dict saved (names hold dots; paths do not mix them)."""
    mapping = metadata.planner_data or {}
    return {k: tuple(mapping.get(k, (k,))) for k in metadata.state_dict_metadata}


def _resolver(
    source: Path, metadata: Metadata, where: dict[str, NestedPath], saved: dict[str, str]
) -> Callable[[str], str]:
    aliases: dict[str, str] | None = None

    def resolve(name: str) -> str:
        nonlocal aliases
        if name in saved:
            return saved[name]
        if aliases is None:  # read only when a name is not saved under itself
            keys = [k for k, p in where.items() if p[:2] == ("pipepar", "aliases")]
            aliases = {str(where[k][2]): v for k, v in _read(source, metadata, {}, keys).items()}
        if aliases.get(name) in saved:
            return saved[aliases[name]]
        close = [n for n in saved if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
        raise ValueError(
            f"{source} has no entry for {name!r} (of {len(saved)} saved, e.g. {close}); load "
            "a checkpoint of the same model, with the same module names"
        )

    return resolve


def _check_shape(metadata: Metadata, key: str, name: str, tensor: Tensor, source: Path) -> None:
    md = metadata.state_dict_metadata[key]
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(tensor.shape):
        shape = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
        raise ValueError(
            f"{name} is {shape} in {source} but {tuple(tensor.shape)} here; load a checkpoint "
            "of the same model configuration"
        )


def _read(
    source: Path, metadata: Metadata, template: dict[str, Any], keys: list[str]
) -> dict[str, Any]:
    """DCP-load ``template`` (tensors filled in place) and ``keys`` (new values) in this process."""
    template = dict(template)
    for key in keys:
        md = metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            template[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:  # a pickled value, which DCP puts in place of this one
            template[key] = None
    if template:
        reader = dcp.FileSystemReader(source)
        _quiet(lambda: dcp.load(template, storage_reader=reader, no_dist=True))
    return template


def _nest(values: Mapping[NestedPath, Any]) -> dict[str, Any]:
    """{path: value} -> the nested dict (a dict of plain values may come back whole, as older
    torch saved it, or value by value; a list of tensors item by item)."""
    root: dict[Any, Any] = {}
    for path, value in values.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
            node[path[-1]].update(value)
        else:
            node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts keyed 0 .. n-1 (DCP's path into a list) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[k] for k in range(len(out))]
    return out


def _extra(nested: Mapping[str, Any]) -> dict[str, Any]:
    wrapped = nested.get("pipepar", {}).get("extra")
    return dict(wrapped[0]) if wrapped else {}


def _quiet(call: Callable[[], T]) -> T:
    """``call()`` without DCP's warning that one process saves or loads alone: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return call()


def _check_path(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(
            f"path must be a non-empty str or os.PathLike, but got {type(path).__name__}"
        )
    out = Path(os.path.abspath(os.fspath(path)))
    if not out.name:
        raise ValueError(f"path={str(path)!r} names no directory; pass e.g. 'run/ckpt'")
    return out
