"""torch.distributed.pipelining's split points as the ``split=`` both wraps take.

A user of torch's ``pipeline()`` says where stages begin in one of two ways, and pipepar reads
both as module paths where a stage begins (``split=``, :func:`pipepar.program.units.sizes_of`):

- ``split_spec={"layers.4": SplitPoint.BEGINNING}``: a stage begins at the first unit at or
  under ``layers.4``; ``SplitPoint.END``: at the unit after the last one at or under it. A path
  must name a unit or a module holding units: one inside a unit (``layers.4.attn``) is refused,
  since pipepar moves whole units and moving the split to the unit's edge would place the
  stages elsewhere than asked;
- ``pipe_split()`` calls in the forward (:mod:`pipepar.planner.markers`), found by running the
  model on ``sample`` as it is when neither ``balance``, ``split`` nor ``split_spec`` is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching.calls import as_call
from pipepar.core.untouched import untouched
from pipepar.planner.markers import find_markers, marker_split
from pipepar.planner.model_profile import meta_forward
from pipepar.program import units as units_

__all__ = ["spec_split", "torch_split", "unit_order"]


def torch_split(
    model: nn.Module,
    balance: Sequence[int] | None,
    split: Sequence[str] | None,
    split_spec: Mapping[str, Any] | None,
    sample: Any,
    *,
    call_order: bool,
    chain: bool = False,
) -> list[str] | None:
    """``split=`` from ``split_spec``, else from the ``pipe_split()`` markers the forward calls
    on ``sample`` when no balance or split is given; None when neither says anything.

    Args:
        call_order: whether the pipe orders the units as ``sample`` calls them (a pipe of one
            process given ``sample``); else as the model registers them.
        chain: ``sample`` is the model's one input, a tuple too (an ``nn.Sequential`` run as
            a chain of layers); else a call (a tuple is positional arguments).
    """
    if split_spec is not None:
        for label, value in (("balance", balance), ("split", split)):
            if value is not None:
                raise ValueError(
                    f"pass split_spec or {label}, not both (got {label}={list(value)!r}, "
                    f"split_spec={dict(split_spec)!r}); drop one of them"
                )
        return spec_split(_paths(model, sample if call_order else None, chain), split_spec)
    if balance is not None or split is not None or sample is None:
        return None
    found = find_markers(model, _forward(model, sample, chain))
    if found is None:
        return None
    order = found.order if call_order else None
    return marker_split(found, units_.model_units(model, order).paths())


def _forward(model: nn.Module, sample: Any, chain: bool) -> Callable[[], object]:
    """The plain model's forward of the whole ``sample``, its tensors where the parameters
    are; for a model built on ``meta``, the same forward on meta (no values to run on)."""
    call = (sample,) if chain else sample
    param = next(model.parameters(), None)
    if param is not None and param.is_meta:
        return meta_forward(model, call)
    args, kwargs = as_call(call)
    if param is not None:
        args, kwargs = pytree.tree_map(
            lambda v: v.to(param.device) if isinstance(v, Tensor) else v, (args, kwargs)
        )
    return lambda: model(*args, **kwargs)


def _paths(model: nn.Module, sample: Any, chain: bool) -> list[str]:
    return units_.model_units(model, unit_order(model, sample, chain)).paths()


def unit_order(model: nn.Module, sample: Any, chain: bool) -> list[str] | None:
    """The paths of ``model``'s units in the order its forward of ``sample`` first calls them
    (a model may register a module late and call it early: BART's ``layernorm_embedding``,
    CLIP's vision tower before its text tower), as :func:`pipepar.units` finds them; on
    ``meta`` for a model built there, the model and the random states left as they were.
    None without a sample, and for a chain of layers (which run in their order)."""
    if sample is None or chain:
        return None
    run = _forward(model, sample, chain)

    def untouched_run() -> object:
        with untouched(model):
            return run()

    return units_.call_order(model, units_.model_units(model).units, untouched_run)


def spec_split(paths: Sequence[str], split_spec: Mapping[str, Any]) -> list[str]:
    """The module paths where stages begin that ``split_spec`` asks for, over the units
    ``paths`` (in the pipe's order), sorted.

    Example:
        >>> from torch.distributed.pipelining import SplitPoint
        >>> spec_split(["emb", "h.0", "h.1", "head"], {"h.0": SplitPoint.END})
        ['h.1']
    """
    from torch.distributed.pipelining import SplitPoint

    if not isinstance(split_spec, Mapping):
        raise TypeError(
            f"split_spec must be a dict of module path -> SplitPoint, got "
            f"{type(split_spec).__name__}; e.g. split_spec={{{paths[len(paths) // 2]!r}: "
            "SplitPoint.BEGINNING}"
        )
    starts: dict[int, str] = {}
    for path, point in split_spec.items():
        if not isinstance(path, str) or not isinstance(point, SplitPoint):
            raise TypeError(
                f"split_spec maps module paths to SplitPoint.BEGINNING or SplitPoint.END, "
                f"got {path!r}: {point!r}; e.g. {{{paths[len(paths) // 2]!r}: "
                "SplitPoint.BEGINNING}"
            )
        start = _start(paths, path, point is SplitPoint.END)
        if start in starts:
            raise ValueError(
                f"split_spec entries {starts[start]!r} and {path!r} both begin a stage at "
                f"{paths[start]!r}, so a stage between them would hold no unit; keep one"
            )
        starts[start] = path
    return [paths[k] for k in sorted(starts)]


def _start(paths: Sequence[str], path: str, end: bool) -> int:
    """The index of the unit where ``path``'s entry begins a stage; checked."""
    under = [k for k, p in enumerate(paths) if p == path or p.startswith(path + ".")]
    if not under:
        raise ValueError(_not_a_unit(paths, path))
    start = under[-1] + 1 if end else under[0]
    if start in (0, len(paths)):
        point = "END" if end else "BEGINNING"
        raise ValueError(
            f"split_spec {{{path!r}: SplitPoint.{point}}} begins a stage "
            f"{'after the last' if end else 'at the first'} unit, so a stage would hold no "
            f"unit; name a unit in between (the units: {units_.shown(paths)})"
        )
    return start


def _not_a_unit(paths: Sequence[str], path: str) -> str:
    holder = next((p for p in paths if path.startswith(p + ".")), None)
    if holder is not None:
        return (
            f"split_spec names {path!r}, inside the unit {holder!r}; pipepar moves whole units "
            f"to stages and cannot split inside one: name {holder!r} (SplitPoint.BEGINNING "
            f"or SplitPoint.END) instead (the units: {units_.shown(paths)})"
        )
    return (
        f"split_spec names {path!r}, which is not a unit of the model nor holds one; the "
        f"units are {units_.shown(paths)} (pipepar.units(model) lists them all)"
    )
