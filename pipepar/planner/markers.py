"""Where ``torch.distributed.pipelining.pipe_split()`` markers stand in a model's forward.

torch's ``pipeline()`` captures the forward as a graph and cuts it at each marker. pipepar
captures no graph: its stages are runs of units (:mod:`pipepar.program.units`), so a marker
splits the model where it stands between two unit calls, and the stage it opens begins at the
next unit the forward calls. Finding that place takes one forward: :func:`find_markers` runs
the user's sample as it is (what the plain model runs: a one-row slice would fail through a
training-mode batch norm) without gradients and records, in call order, each unit's call and
each marker (``torch.ops.pippy._pipe_split``, which a torch-function mode sees, as torch's
``pipe_split()`` is nothing but that call; in eager mode it does nothing, so the markers
cost a pipe nothing when it runs). That forward leaves the model and torch as they were
(:func:`~pipepar.core.untouched.untouched`: buffers, what the forward stored on its modules,
the random generators' states), so the first step is the plain model's.

A marker inside a unit (in a transformer block's forward), before the first unit, after the
last, or two markers with no unit called between them cannot make a stage of whole units:
each is a ``ValueError`` naming the marker's line in the model's code and the units around it.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pipepar.core.untouched import untouched
from pipepar.program import units as units_

__all__ = ["Markers", "find_markers", "marker_split"]

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PIPEPAR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class Markers:
    """What one forward called, in order: the units (first calls) and the markers.

    Attributes:
        order: unit paths in the order the forward first called them.
        starts: for each marker, the index in ``order`` of the first unit called after it.
        lines: for each marker, where the model's code called it (``file:line``).
    """

    order: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def markers_defined() -> bool:
    """Whether ``pipe_split()`` exists in this process: torch registers its operator when
    ``torch.distributed.pipelining`` is imported, so a model that calls it imported it."""
    return hasattr(torch.ops, "pippy") and hasattr(torch.ops.pippy, "_pipe_split")


def find_markers(model: nn.Module, run: Callable[[], object]) -> Markers | None:
    """The markers ``run()`` (a forward of ``model``) calls, or None when it calls none;
    ``model`` and the random states are as they were before (:func:`untouched`).

    Raises:
        ValueError: a marker inside a unit, before the first unit or after the last, or two
            markers with no unit called between them.
    """
    if not markers_defined():
        return None
    units = units_.model_units(model).units
    seen = _Watch()
    handles = [
        h
        for u in units
        for h in (
            u.module.register_forward_pre_hook(seen.entered(u.path)),
            u.module.register_forward_hook(seen.left(u.path), always_call=True),
        )
    ]
    try:
        with torch.no_grad(), untouched(model), seen:
            run()
    finally:
        for h in handles:
            h.remove()
    if not seen.markers.lines:
        return None
    _check_between(seen.markers, units_.model_units(model, seen.markers.order).paths())
    return seen.markers


class _Watch(TorchFunctionMode):
    """Records unit calls (through the hooks it hands out) and marker calls (as a mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.markers = Markers()
        self._inside: list[str] = []
        op = torch.ops.pippy._pipe_split
        self._ops = (op, op.default)

    def entered(self, path: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._inside.append(path)
            if path not in self.markers.order:
                self.markers.order.append(path)

        return hook

    def left(self, path: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._inside and self._inside[-1] == path:
                self._inside.pop()

        return hook

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if func in self._ops:
            self._marker()
        return func(*args, **(kwargs or {}))

    def _marker(self) -> None:
        line = _caller()
        if self._inside:
            raise ValueError(
                f"pipe_split() at {line} is called inside the unit {self._inside[0]!r}; "
                "pipepar moves whole units (pipepar.units(model)) to stages and cannot split "
                "inside one: call pipe_split() in the forward between two unit calls, or "
                f"pass split=[module paths where stages begin] instead"
            )
        self.markers.starts.append(len(self.markers.order))
        self.markers.lines.append(line)


def _caller() -> str:
    """``file:line`` of the model code that called ``pipe_split()`` (not torch's, not ours)."""
    for frame in reversed(traceback.extract_stack()):
        name = os.path.abspath(frame.filename)
        if not name.startswith((_TORCH, _PIPEPAR)):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


def _check_between(found: Markers, paths: Sequence[str]) -> None:
    """Every stage the markers open holds a unit: a marker after the first unit call, before
    another one, and no two markers with no unit called between them."""
    last = len(found.order)
    for k, (start, line) in enumerate(zip(found.starts, found.lines)):
        if start == 0 or start == last:
            where = "before the first" if start == 0 else "after the last"
            unit = found.order[0 if start == 0 else -1] if found.order else None
            raise ValueError(
                f"pipe_split() at {line} is called {where} unit the forward calls "
                f"({unit!r}), so a stage would hold no unit; "
                f"call it between two unit calls (the units: {units_.shown(paths)})"
            )
        if k and found.starts[k - 1] == start:
            raise ValueError(
                f"pipe_split() at {found.lines[k - 1]} and at {line} are called with no unit "
                f"called between them (both before {found.order[start]!r}), so a stage would "
                "hold no unit; keep one of them"
            )


def marker_split(found: Markers, paths: Sequence[str]) -> list[str]:
    """``split=``: the module paths where the markers' stages begin, for a pipe whose units
    are in the order ``paths``; checked to give the stages the markers make (a model that
    registers its units in another order than it calls them may not).

    Example:
        >>> marker_split(Markers(["a", "b", "c"], [1], ["m.py:3"]), ["a", "b", "c"])
        ['b']
    """
    split = [found.order[k] for k in found.starts]
    stage = {p: sum(k <= i for k in found.starts) for i, p in enumerate(found.order)}
    sizes = units_.stages_from_split(paths, split)
    runtime = dict(zip(paths, units_.stage_of_units(sizes)))
    moved = [p for p in found.order if runtime[p] != stage[p]]
    if moved:
        raise ValueError(
            f"the pipe_split() markers (at {', '.join(found.lines)}) put {moved[0]!r} on "
            f"stage {stage[moved[0]]}, but this pipe orders the units as the model registers "
            f"them ({units_.shown(paths)}) and would put it on stage {runtime[moved[0]]}; pass "
            "balance=[units per stage] in that order instead"
        )
    return split
