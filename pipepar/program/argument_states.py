"""The objects a unit's call changes, given to its recompute as they were before the call.

A recomputed unit must run on what its first run saw. Tensors it writes into in place are
refused (:mod:`pipepar.program.recompute` checks their versions), but an argument may also be
an object the unit updates by rebinding what it holds: a key-value cache whose layer appends
the call's keys (``self.keys = torch.cat([self.keys, new])``), a list the unit appends to, a
dict it fills. Run again on that object, the recompute sees the first run's additions as well
as its own (a cache of twice the sequence: attention over doubled keys, a mask of the wrong
size, or values silently different where no mask checks the size).

What changed is learned from the call itself, not from the objects' classes: before the first
run, :class:`ArgumentStates` notes what every object reachable from the arguments holds (an
object's attributes, a list's items, a dict's entries), and after it, which of them the run
changed. A recompute then gets copies of the arguments made from what they held before (the
caller's objects keep the first run's result, as without recompute): no object is written
while another stage may read it, so recomputes on other threads need no lock.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ArgumentStates", "replaying"]

_DEPTH = 6
"""How many objects deep the arguments are followed (a cache, its layer list, a layer: 3)."""

_OPAQUE = (
    Tensor, nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.ModuleType, torch.dtype, torch.device, str, bytes, int, float, complex, bool,
    type(None),
)  # fmt: skip
"""Values never followed: tensors (their in-place writes are checked apart), the model's own
modules, code, and immutable scalars."""


class ArgumentStates:
    """What the objects among one call's arguments held before it, and whether it changed them.

    Example:
        >>> log = []
        >>> states = ArgumentStates((log,), {})
        >>> log.append(1)
        >>> states.settle()
        >>> states.as_before((log,), {})[0]
        ([],)
        >>> log
        [1]
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._before: dict[int, tuple[Any, Any]] = {}
        _note((args, *kwargs.values()), self._before, _DEPTH)  # not the dict: ** makes anew
        self.changed = False

    def settle(self) -> None:
        """After the first run: note whether it changed any object it was given. A meta tensor
        it replaced by a real one is kept as replaced: across ranks, a value another rank's
        stage made is held on ``meta`` and the first run received its real value, which the
        recompute (running outside the run's modes) cannot receive again."""
        self.changed = False
        for obj, state in self._before.values():
            after = _state(obj)
            if after != state:
                self.changed = True
                if state.keys:
                    state.values = _received(state.values, dict(after.values))

    def as_before(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments as the first run got them: the same objects when it changed none,
        else copies of every object noted, holding what it held before."""
        if not self.changed:
            return args, kwargs
        copies: dict[int, Any] = {}
        named = {k: _rebuilt(v, self._before, copies) for k, v in kwargs.items()}
        return _rebuilt(args, self._before, copies), named


def replaying(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``forward`` for a checkpointed call: the first call notes the arguments' objects, every
    later one (a recompute) runs on them as they were before the first."""
    states = ArgumentStates(args, kwargs)
    calls = 0

    def run(*given: Any, **named: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            out = forward(*given, **named)
            states.settle()
            return out
        before, before_named = states.as_before(given, named)
        return forward(*before, **before_named)

    return run


def _state(obj: Any) -> Any:
    """What ``obj`` holds, compared by identity: its items or attributes."""
    if type(obj) is list:
        return _Held(list(obj))
    if type(obj) is dict:
        return _Held(list(obj.items()), keys=True)
    return _Held(list(vars(obj).items()), keys=True)


class _Held:
    """A container's values, equal to another's when each value is the same object."""

    def __init__(self, values: list[Any], keys: bool = False) -> None:
        self.values, self.keys = values, keys

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Held) or len(other.values) != len(self.values):
            return False
        if self.keys:
            return all(
                k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(self.values, other.values)
            )
        return all(a is b for a, b in zip(self.values, other.values))

    __hash__ = None  # type: ignore[assignment]


def _received(before: list[Any], after: dict[Any, Any]) -> list[Any]:
    """``before``'s items, each meta tensor the run replaced by a real one of its shape taken
    as replaced."""
    return [(k, after[k] if _realised(v, after.get(k)) else v) for k, v in before]


def _realised(before: Any, after: Any) -> bool:
    if not (isinstance(before, Tensor) and isinstance(after, Tensor)):
        return False
    with torch._C.DisableTorchFunction():  # read unseen by the pipe's modes
        return before.is_meta and not after.is_meta and before.shape == after.shape


def _followed(value: Any) -> bool:
    """Whether ``value`` is an object whose contents are noted."""
    if isinstance(value, _OPAQUE):
        return False
    return type(value) in (list, dict) or hasattr(value, "__dict__")


def _note(value: Any, into: dict[int, tuple[Any, Any]], depth: int) -> None:
    """Note the state of every object reachable from ``value`` (``depth`` objects deep)."""
    if depth == 0 or id(value) in into:
        return
    if type(value) is tuple or _is_named_tuple(value):
        for item in value:
            _note(item, into, depth)
        return
    if not _followed(value):
        return
    state = _state(value)
    into[id(value)] = (value, state)
    for item in state.values:
        _note(item[1] if state.keys else item, into, depth - 1)


def _rebuilt(value: Any, before: dict[int, tuple[Any, Any]], copies: dict[int, Any]) -> Any:
    """``value`` with every noted object replaced by a copy holding its noted state."""
    if type(value) is tuple:
        return tuple(_rebuilt(v, before, copies) for v in value)
    if _is_named_tuple(value):
        return type(value)._make(_rebuilt(v, before, copies) for v in value)
    noted = before.get(id(value))
    if noted is None or noted[0] is not value:
        return value
    if id(value) in copies:
        return copies[id(value)]
    state = noted[1]
    if type(value) is list:
        out: Any = []
        copies[id(value)] = out
        out.extend(_rebuilt(v, before, copies) for v in state.values)
        return out
    out = {} if type(value) is dict else copy.copy(value)
    copies[id(value)] = out
    held = {k: _rebuilt(v, before, copies) for k, v in state.values}
    if type(value) is dict:
        out.update(held)
    else:
        out.__dict__.clear()
        out.__dict__.update(held)
    return out


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_make")
