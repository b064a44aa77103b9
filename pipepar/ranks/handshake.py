"""Wrap-time agreement: every rank of the grid must build the same pipeline.

Ranks that disagree on ``balance``, ``chunks``, the schedule, ``dp`` or the model would post
receives that never match a send, or receive bytes into buffers of another shape (gloo aborts
the process on a size mismatch). So before any pipeline group exists, each rank posts a
fingerprint of its arguments to the c10d store under a key unique to this ``wrap`` call, reads
every other rank's, and all ranks raise the same ``ValueError`` when they differ, naming the
ranks and both values. A rank whose arguments are invalid on their own posts its error instead
and raises at once; its peers raise an error naming it.

The store is used rather than a collective so that no rank ever blocks on a peer that already
gave up. A rank that never arrives is reported after ``timeout`` seconds; the first rank to see
every entry (or to give up) writes a verdict with compare-and-set, and every rank follows that
verdict, so a late rank cannot proceed alone into group creation after the others gave up.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from pipepar.core.schedule import Schedule
from pipepar.ranks.failure import PipelineError

__all__ = ["agree", "fingerprint", "refuse"]

logger = logging.getLogger(__name__)

_POLL_S = 0.005
_GO = "go"
_calls: Counter[tuple[int, ...]] = Counter()  # wrap calls per parent group, in step on all ranks


def fingerprint(
    model: nn.Module,
    balance: list[int],
    *,
    chunks: int,
    schedule: Schedule,
    dp: int,
    checkpoint: str,
    state_dict: Mapping[str, Any] | None,
) -> dict[str, str]:
    """What every rank of a grid must agree on, as printable strings.

    The schedule counts by its per-worker action lists (``repr`` names the stage of each
    action) and its placement: what every rank executes, in order.

    Example:
        >>> from pipepar.core.schedule import gpipe
        >>> f = fingerprint(nn.Sequential(nn.ReLU()), [1], chunks=2, schedule=gpipe(1, 2),
        ...                 dp=1, checkpoint="never", state_dict=None)
        >>> f["chunks"], f["schedule"].split()[0]
        ('2', 'gpipe')
    """
    workers = range(schedule.n_workers)
    actions = "|".join(" ".join(map(repr, schedule.worker(w))) for w in workers)
    actions += f" placement {list(schedule.placement)}"
    return {
        "balance": str(list(balance)),
        "chunks": str(chunks),
        "schedule": f"{schedule.name} (actions {_digest(actions)})",
        "dp": str(dp),
        "checkpoint": repr(checkpoint),
        "model": _describe(model),
        "state_dict": "given" if state_dict is not None else "None",
    }


def refuse(error: BaseException, *, group: dist.ProcessGroup | None) -> None:
    """Post that this rank's arguments are invalid, so its peers fail instead of waiting.

    Example:
        >>> refuse(ValueError("chunks must be positive"), group=None)  # doctest: +SKIP
    """
    try:
        store, me, _ = _open(group)
        store.set(f"entry/{me}", json.dumps({"error": f"{type(error).__name__}: {error}"}))
    except Exception:  # no usable store: peers will report this rank as missing instead
        logger.debug("could not post a refused wrap", exc_info=True)


def agree(
    fields: dict[str, str], *, group: dist.ProcessGroup | None, timeout: float | None
) -> None:
    """Post ``fields``, wait for every rank's, and raise on every rank unless all agree.

    Args:
        fields: this rank's :func:`fingerprint`.
        group: the parent group of the grid (``None`` for the world).
        timeout: seconds to wait for the slowest rank (``None``: no limit).

    Raises:
        ValueError: some rank refused its arguments, or ranks disagree (both values named).
        PipelineError: some rank did not call ``wrap`` within ``timeout`` seconds.

    Example:
        >>> agree(fingerprint(model, [4, 4], ...), group=None, timeout=300.0)  # doctest: +SKIP
    """
    store, me, ranks = _open(group)
    store.set(f"entry/{me}", json.dumps({"fields": fields}))
    keys = [f"entry/{g}" for g in range(len(ranks))]
    verdict = _verdict(store, keys, ranks, timeout)
    if verdict != _GO:
        raise PipelineError(verdict)
    entries = [json.loads(_text(store.get(k))) for k in keys]
    _check(entries, ranks)


def _open(group: dist.ProcessGroup | None) -> tuple[dist.Store, int, list[int]]:
    """The store namespace of this wrap call, this rank's group rank and the group's ranks."""
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    _calls[tuple(ranks)] += 1
    prefix = f"pipepar/wrap/{'-'.join(map(str, ranks))}/{_calls[tuple(ranks)]}/"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    return store, dist.get_rank(parent), ranks


def _verdict(store: dist.Store, keys: list[str], ranks: list[int], timeout: float | None) -> str:
    """``"go"`` once every entry is posted, else why not; the first rank to decide decides."""
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [ranks[g] for g, k in enumerate(keys) if not store.check([k])]
            give_up = (
                f"rank(s) {missing} did not call ppd.wrap within {timeout:g} s, while ranks "
                f"{[r for r in ranks if r not in missing]} did; every rank of the group must "
                "call ppd.wrap (or raise the timeout if they are just slow to get there)"
            )
            return _text(store.compare_set("verdict", "", give_up))
        time.sleep(_POLL_S)
    return _text(store.compare_set("verdict", "", _GO))


def _check(entries: list[dict[str, Any]], ranks: list[int]) -> None:
    refused = [(ranks[g], e["error"]) for g, e in enumerate(entries) if "error" in e]
    if refused:
        rank, error = refused[0]
        others = f" (and {len(refused) - 1} more rank(s))" if len(refused) > 1 else ""
        raise ValueError(
            f"rank {rank}{others} refused the arguments of ppd.wrap: {error}; fix them there: "
            "every rank must call ppd.wrap with the same, valid arguments"
        )
    disagreements = [
        _disagreement(name, [e["fields"].get(name) for e in entries], ranks)
        for name in entries[0]["fields"]
    ]
    found = [d for d in disagreements if d]
    if found:
        raise ValueError(
            f"ranks disagree on the arguments of ppd.wrap: {'; '.join(found)}; pass the same "
            "model and arguments to ppd.wrap on every rank"
        )


def _disagreement(name: str, values: list[str | None], ranks: list[int]) -> str:
    """``""`` when all ranks agree on ``name``, else each value with the ranks holding it."""
    holders: dict[str | None, list[int]] = {}
    for rank, value in zip(ranks, values, strict=True):
        holders.setdefault(value, []).append(rank)
    if len(holders) == 1:
        return ""
    by_count = sorted(holders.items(), key=lambda item: -len(item[1]))  # the odd ones last
    parts = [f"{value} on rank(s) {who}" for value, who in by_count]
    return f"{name} is " + " but ".join(parts)


def _describe(model: nn.Module) -> str:
    """The model's children, their types and their tensors' shapes, as a digest."""
    children = list(model.named_children())
    shapes = [
        (
            name,
            type(layer).__name__,
            [(k, tuple(t.shape), str(t.dtype)) for k, t in _tensors(layer)],
        )
        for name, layer in children
    ]
    n_values = sum(v.numel() for _, layer in children for _, v in _tensors(layer))
    what = "layers" if isinstance(model, nn.Sequential) else "children"
    return f"{len(children)} {what} of {n_values} values (structure {_digest(repr(shapes))})"


def _tensors(layer: nn.Module) -> list[tuple[str, Any]]:
    return list(layer.named_parameters()) + list(layer.named_buffers())


def _digest(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
