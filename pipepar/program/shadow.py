"""Another rank's stages followed on ``meta``: their units stood in for, the code between them on
meta twins.

A rank that follows a learned route (:mod:`pipepar.program.ranks`) runs the model's code for
every stage, but computes only its own: a unit of another rank's stage is not run, its output
stood in by meta tensors of the shape the route learned (:func:`template`, :func:`from_template`,
:func:`skip_elsewhere`), and the few operations between such units run under :class:`ToMeta`,
which gives each real tensor they are handed its meta twin.

A shadow stage holds no real tensor (:func:`on_meta`): the only operations there that still make
one are those given no tensor at all (``torch.arange``, ``torch.tensor``, ``torch.full``), and
their outputs become meta twins whose value is known. Were a constant kept real, the rank that
computes the stage would send it (its stage made it) while the rank that follows it would use its
own copy, and their messages would part ways (a sliding-window key-value cache's
``torch.tensor(window)``, made by the first stage and moved by every layer's cache); nor could a
write into it in place (a mask filled in) reach the real copy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.overrides import TorchFunctionMode

from pipepar.program.cut import map_arguments
from pipepar.program.driver import active

__all__ = ["ToMeta", "from_template", "on_meta", "skip_elsewhere", "template"]


class ToMeta(TorchFunctionMode):
    """Another stage's code on a rank that follows a route: every real tensor an operation
    is given becomes its ``meta`` twin (small integer values kept for the model's reads)."""

    def __init__(
        self, meta_of: Callable[[Tensor], Tensor], twin: Callable[[Tensor], Tensor]
    ) -> None:
        super().__init__()
        self.meta_of, self.twin = meta_of, twin

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        args = tuple(map_arguments(a, self._meta) for a in args)
        kwargs = {k: map_arguments(v, self._meta) for k, v in (kwargs or {}).items()}
        return on_meta(func(*args, **kwargs), self.twin)

    def _meta(self, t: Tensor) -> Tensor:
        return t if t.is_meta else self.meta_of(t)


def on_meta(out: Any, twin: Callable[[Tensor], Tensor]) -> Any:
    """What an operation of a shadow stage returned, each real tensor in it (a factory's) made
    ``twin(t)``, its meta twin; ``out`` itself when it holds none."""
    if isinstance(out, Tensor):
        return out if out.is_meta else twin(out)
    if type(out) in (tuple, list) and any(_real(t) for t in out):
        return type(out)(twin(t) if _real(t) else t for t in out)
    return out


def _real(value: Any) -> bool:
    return isinstance(value, Tensor) and not value.is_meta


def template(output: Any) -> tuple[Any, list[Any]]:
    """The shape of a unit's output: its structure, and each tensor's shape and dtype."""
    leaves, spec = pytree.tree_flatten(output)
    described = [
        (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, Tensor) else t for t in leaves
    ]
    return spec, described


def from_template(shape: tuple[Any, list[Any]]) -> Any:
    """An output of that shape on ``meta``; one that requires grad is made by an operation,
    as the unit's was (the code after the unit may write into it in place, as
    ``nn.ReLU(inplace=True)`` does, which a leaf would refuse)."""
    spec, described = shape
    leaves = [
        _stand_in(*d)
        if isinstance(d, tuple) and len(d) == 3 and isinstance(d[1], torch.dtype)
        else d
        for d in described
    ]
    return pytree.tree_unflatten(leaves, spec)


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> Tensor:
    # Made beside the shadow's modes: a stand-in has no value to follow, and passing the
    # modes would cost more than the rest of the unit call.
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        t = torch.empty(shape, dtype=dtype, device="meta")
        if requires_grad and dtype.is_floating_point:
            return t.requires_grad_().clone()
        return t


def skip_elsewhere(
    units: Sequence[Any], stage_of_unit: Sequence[int], mine: Collection[int]
) -> None:
    """Let every unit with parameters of a stage not in ``mine`` be skipped by a rank that
    follows a route (its output stood in on ``meta``; run as usual otherwise)."""
    for unit, s in zip(units, stage_of_unit):
        if s not in mine and unit.has_parameters:
            unit.module.forward = _skippable(unit.module.forward)


def _skippable(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        driver = active()
        follower = driver.follower if driver is not None else None
        stand_in = follower.stub() if follower is not None else None
        return forward(*args, **kwargs) if stand_in is None else stand_in()

    return run
