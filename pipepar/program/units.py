"""The units a model is laid out in, and which stage each belongs to.

A *unit* is a submodule that moves to one stage as a whole: a transformer block, an embedding,
a norm, a head. pipepar finds them without tracing the model's code: it descends from the model
through every module that holds a list of repeated blocks (an ``nn.ModuleList`` or
``nn.Sequential`` of two or more modules with parameters, at any depth), and takes each child of
those modules as a unit. For transformers' GPT-2 that is ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` ... ``transformer.ln_f``,
``lm_head``; for an ``nn.Sequential`` it is its layers.

Parameters held directly by a module that was descended into (a ViT's class token and position
embedding) are *loose*: they live with the first unit with parameters inside that module.

Units are in the order the model calls them when a sample input was run (a model may register a
module late and call it early), else in the order the modules were registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.untouched import untouched

__all__ = [
    "ModelUnits",
    "Unit",
    "model_units",
    "modules_of",
    "sizes_of",
    "stage_of_units",
    "stages_from_split",
    "units",
]


@dataclass(frozen=True)
class Unit:
    """One unit: its module path in the model and the module.

    Example:
        >>> [(u.path, type(u.module).__name__) for u in units(zoo.mlp(depth=1, width=4))]
        [('0', 'Linear'), ('1', 'ReLU')]
    """

    path: str
    module: nn.Module

    @property
    def has_parameters(self) -> bool:
        """Units with parameters mark where stages begin; the others compute where called."""
        return any(True for _ in self.module.parameters())


@dataclass(frozen=True)
class ModelUnits:
    """The units of a model and its loose parameters, by the module path of their holder."""

    units: list[Unit]
    loose: list[tuple[str, nn.Parameter]]

    def paths(self) -> list[str]:
        return [u.path for u in self.units]


def model_units(model: nn.Module, order: Sequence[str] | None = None) -> ModelUnits:
    """Lay ``model`` out in units.

    Args:
        model: any module.
        order: unit paths in call order (from :func:`call_order`); units not in it keep their
            registration order after those that are.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> model_units(m).paths()
        ['0', '1', '2']
    """
    units: list[Unit] = []
    loose: list[tuple[str, nn.Parameter]] = []
    _descend(model, "", units, loose)
    if not units:
        units = [Unit("", model)]
        loose = []
    if order is not None:
        rank = {path: k for k, path in enumerate(order)}
        units.sort(key=lambda u: rank.get(u.path, len(rank)))
    return ModelUnits(units, loose)


def modules_of(model: nn.Module, chain: bool) -> list[nn.Module]:
    """The modules a pipe runs as its units: an ``nn.Sequential`` chain's layers, else the
    units of :func:`model_units`."""
    if chain:
        return list(model.children())
    return [u.module for u in model_units(model).units]


def _descend(
    module: nn.Module, prefix: str, units: list[Unit], loose: list[tuple[str, nn.Parameter]]
) -> None:
    for name, p in module.named_parameters(recurse=False):
        loose.append((_join(prefix, name), p))
    for name, child in module.named_children():
        path = _join(prefix, name)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or _holds_blocks(child):
            _descend(child, path, units, loose)
        else:
            units.append(Unit(path, child))


def _holds_blocks(module: nn.Module) -> bool:
    """True if ``module`` is or contains a list of two or more blocks: modules made of modules,
    with parameters (an MLP's ``Sequential`` of two linear layers is not a list of blocks)."""
    lists = (
        m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
    )
    return any(sum(1 for c in m.children() if _is_block(c)) >= 2 for m in lists)


def _is_block(module: nn.Module) -> bool:
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def call_order(model: nn.Module, units: Sequence[Unit], run: Callable[[], object]) -> list[str]:
    """The paths of ``units`` in the order ``run()`` first calls them (e.g. a sample forward)."""
    seen: dict[str, None] = {}
    handles = [u.module.register_forward_pre_hook(_recorder(seen, u.path)) for u in units]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return list(seen)


def _recorder(seen: dict[str, None], path: str) -> Callable[[nn.Module, Any], None]:
    def hook(module: nn.Module, args: object) -> None:
        seen.setdefault(path, None)

    return hook


def stages_from_split(paths: Sequence[str], split: Sequence[str]) -> list[int]:
    """Units per stage when a new stage begins at each path of ``split``.

    A path may name a unit or a module that holds units (the stage begins at its first unit).

    Example:
        >>> stages_from_split(["emb", "h.0", "h.1", "h.2", "head"], ["h.1", "h.2"])
        [2, 1, 2]
    """
    if isinstance(split, str) or not all(isinstance(s, str) for s in split):
        raise TypeError(
            f"split must be a list of module paths, but got {split!r}; e.g. "
            f"split=[{paths[len(paths) // 2]!r}]"
        )
    starts = [_first_unit(paths, s) for s in split]
    bounds = [0, *starts, len(paths)]
    if any(b >= a for b, a in pairwise(bounds[1:])) or (starts and starts[0] == 0):
        raise ValueError(
            f"split={list(split)} must name modules in model order, each after the first unit "
            f"({paths[0]!r}); the units are {shown(paths)}"
        )
    return [b - a for a, b in pairwise(bounds)]


def _first_unit(paths: Sequence[str], path: str) -> int:
    for k, p in enumerate(paths):
        if p == path or p.startswith(path + "."):
            return k
    raise ValueError(
        f"split names {path!r}, which is not a unit of the model nor holds one; "
        f"the units are {shown(paths)} (pipepar.units(model) lists them all)"
    )


def shown(paths: Sequence[str]) -> str:
    """A short listing of unit paths for messages (the first four and the last three)."""
    shown = list(paths) if len(paths) <= 8 else [*paths[:4], "...", *paths[-3:]]
    return "[" + ", ".join(shown) + "]"


def sizes_of(
    lay: ModelUnits, balance: Sequence[int] | None, split: Sequence[str] | None
) -> list[int]:
    """Units per stage from ``balance`` (units per stage, checked against the layout) or
    ``split`` (module paths where stages begin); exactly one of them.

    Example:
        >>> sizes_of(model_units(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])), None, ["2"])
        [2, 2]
    """
    paths = lay.paths()
    if split is not None and balance is not None:
        raise ValueError(
            f"pass balance or split, not both (got balance={list(balance)}, split={list(split)})"
        )
    if split is not None:
        return stages_from_split(paths, split)
    if balance is None:
        raise ValueError("balance, split or sample is needed to split the model into stages")
    total = sum(balance) if all(isinstance(b, int) for b in balance) else None
    if total is not None and total != len(paths):
        raise ValueError(
            f"balance {list(balance)} counts {total} units but the model lays out in "
            f"{len(paths)}: {shown(paths)}; give every unit a stage, or pass "
            f"split=[module paths where stages begin] instead"
        )
    return validation.check_balance(balance, len(paths))


def stage_of_units(sizes: Sequence[int]) -> list[int]:
    """Each unit's stage, in unit order, for ``sizes`` units per stage.

    Example:
        >>> stage_of_units([2, 1])
        [0, 0, 1]
    """
    return [s for s, n in enumerate(sizes) for _ in range(n)]


def owners(lay: ModelUnits, stage_of_unit: Sequence[int]) -> dict[int, int]:
    """The stage that holds each parameter (by ``id``): a parameter used by units of several
    stages (tied weights) is held by the first; loose parameters by the first unit with
    parameters under their holder module (stage 0 for the model's own)."""
    owner: dict[int, int] = {}
    for unit, s in zip(lay.units, stage_of_unit):
        for p in unit.module.parameters():
            owner.setdefault(id(p), s)
    for path, p in lay.loose:
        holder = path.rpartition(".")[0]
        owner.setdefault(id(p), _first_stage_under(lay, stage_of_unit, holder))
    return owner


def state_owners(
    model: nn.Module, stage_of_unit: Sequence[int], order: Sequence[str] | None = None
) -> dict[str, int]:
    """The stage each entry of ``model.state_dict()`` is taken from, under every name: the
    stage that holds a parameter (:func:`owners`), the stage of the unit a buffer is in (only
    the stage running a unit updates its buffers: batch-norm statistics, counters), and for a
    buffer outside every unit the stage its holder module's loose parameters would go to (the
    first unit with parameters under it; stage 0 for the model's own buffers).
    ``stage_of_unit`` lists the units in ``order`` (as :func:`model_units` takes it).

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> state_owners(m, [0, 1])["1.running_mean"]
        1
    """
    lay = model_units(model, order)
    owner = owners(lay, stage_of_unit)
    for unit, s in zip(lay.units, stage_of_unit):
        for b in unit.module.buffers():
            owner.setdefault(id(b), s)
    found: dict[str, int] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        known = owner.get(id(t))
        if known is None:
            known = _first_stage_under(lay, stage_of_unit, name.rpartition(".")[0])
        found[name] = known
    return found


def _first_stage_under(lay: ModelUnits, stage_of_unit: Sequence[int], holder: str) -> int:
    for unit, s in zip(lay.units, stage_of_unit):
        if unit.has_parameters and (not holder or unit.path.startswith(holder + ".")):
            return s
    return 0


def iter_stage_units(lay: ModelUnits, stage_of_unit: Sequence[int], s: int) -> Iterator[Unit]:
    for unit, t in zip(lay.units, stage_of_unit):
        if t == s:
            yield unit


def units(model: nn.Module, sample: Any = None) -> list[Unit]:
    """The units pipepar lays ``model`` out in: what ``balance`` counts and ``split`` names.

    Args:
        model: any module.
        sample: an example call (tensor, tuple of positional arguments, or dict of keyword
            arguments); the units are then in the order the model calls them, found by a
            forward without gradients on the sample as it is (nothing the plain model would
            not run), after which the model and the random states are as they were (what
            its forward stored on its modules included: :mod:`pipepar.core.untouched`).

    Example:
        >>> [u.path for u in units(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
        ['0', '1']

    Returns:
        The units in the order the model runs them, each a :class:`Unit` with its module
        path (``"transformer.h.3"``) and module.
    """
    if sample is None:
        return model_units(model).units
    from pipepar.batching.calls import as_call

    args, kwargs = as_call(sample)
    # Each buffer once, under its first name: functional_call ties the others to it.
    buffers = {name: b.clone() for name, b in model.named_buffers()}

    def run() -> object:
        with untouched(model):
            return torch.func.functional_call(model, buffers, args, kwargs)

    order = call_order(model, model_units(model).units, run)
    return model_units(model, order).units
