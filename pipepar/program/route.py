"""Where a model's values cross stage boundaries, learned once per kind of call and then followed.

The cut (:mod:`pipepar.program.cut`) finds crossings as the model runs: every torch operation
passes through its torch-function mode, which costs Python time per operation. Most models hand
each stage what it needs through the arguments of its units (the hidden state given to the next
block, a mask or rotary table given to every block, the head's tied weight), and do so the same
way on every call with the same arguments. So the first call of a kind runs under the mode while
the units' hooks make the crossings at their arguments and write down where: a :class:`Route`
(for each unit call in order, which argument positions cross, from which stage). If the mode
found no crossing besides those, later calls of the same :func:`signature` run without the mode:
the hooks make the same crossings at the same places.

Such a call is checked as it runs: the same units in the same order, the same number of tensor
arguments, and no output of an earlier stage's unit reaching a later stage where the route has
no crossing; when it will run a backward, its autograd graph is walked once as it runs (each
value's graph when the value crosses into another stage, the rest at the call's end:
:class:`GraphCheck`), so a value that reached another stage outside any unit's arguments (in
the model's own code between units) is found too. What the walk read of each stage's graph
(its nodes and their next nodes) is handed to that stage's backward, whose planning would read
the same graph again (:func:`~pipepar.core.split_backward.plan_backward`). A call that goes
another way raises :class:`PathChanged`; the pipe forgets the route and runs the mini-batch
again under the mode (from the same random state), so results stay the plain model's. A route
whose crossings differ between micro-batches of the same signature is never followed.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipepar.core.split_backward import NextNodes

__all__ = [
    "GraphCheck",
    "PathChanged",
    "Route",
    "Routes",
    "UnitCall",
    "check_graphs",
    "replaced",
    "signature",
    "tensors_in",
]


class PathChanged(RuntimeError):
    """A call followed a route it did not take (raised inside the forward, caught by the pipe)."""

    def __init__(self, key: Hashable, why: str) -> None:
        super().__init__(f"the model took another path than the learned route: {why}")
        self.key = key


@dataclass(frozen=True)
class UnitCall:
    """One unit call of a route: the unit, how many tensors its arguments hold, and which of
    them (by position) cross from which stage."""

    unit: int
    n_tensors: int
    crossings: tuple[tuple[int, int], ...]


@dataclass
class Route:
    """The unit calls of one micro-batch's forward, and the stage of each tensor it returns
    (by position among the output's leaves)."""

    calls: list[UnitCall] = field(default_factory=list)
    outputs: tuple[tuple[int, int], ...] = ()
    sends: int = 0
    """Across ranks: how many values the rank that learned it sent to other ranks (once they
    are sent, a rank with no later stage stops following the forward)."""
    templates: dict[int, Any] = field(default_factory=dict, compare=False)
    """Per unit call, the shape of what it returned (a rank skips the units of other stages
    and stands their outputs in on ``meta``)."""


class Routes:
    """The routes a pipe learned, by :func:`signature`; thread-safe (micro-batches learn on
    their own threads)."""

    def __init__(self) -> None:
        self._known: dict[Hashable, Route] = {}
        self._distrusted: set[Hashable] = set()
        self._waiting: set[Hashable] = set()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Route | None:
        """The route to follow for calls of ``key``, or None (learn it under the mode)."""
        return self._known.get(key)

    def learned(self, key: Hashable, route: Route) -> None:
        """Keep what a call of ``key`` took; two different routes for one key distrust it."""
        with self._lock:
            if key in self._distrusted:
                return
            known = self._known.get(key)
            if known is None:
                self._known[key] = route
            elif known != route:
                self._distrust(key)

    def wait(self, key: Hashable) -> None:
        """Learn no route for ``key`` from this call (drop one a micro-batch of it learned):
        it left a state on the model that the next call may read, which runs under the mode
        to be seen doing it (:mod:`pipepar.program.kept_state`); :meth:`waited` from then."""
        with self._lock:
            self._known.pop(key, None)
            self._waiting.add(key)

    def waited(self, key: Hashable) -> bool:
        """Whether a call of ``key`` left a state on the model before: a call that ran under
        the mode with it there, and did not use it, learns the route."""
        return key in self._waiting

    def distrust(self, key: Hashable) -> None:
        """Never follow a route for ``key`` again (calls of it always run under the mode)."""
        with self._lock:
            self._distrust(key)

    def _distrust(self, key: Hashable) -> None:
        self._known.pop(key, None)
        self._distrusted.add(key)

    def __len__(self) -> int:
        return len(self._known)

    def __reduce__(self) -> tuple[type[Routes], tuple[()]]:
        return Routes, ()  # a copy of a pipe learns its routes again


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], *context: Hashable) -> Hashable:
    """What decides a call's route: the structure of its arguments, each tensor's shape,
    dtype, device and whether it needs a gradient, every plain value, and ``context`` (the
    model's training flag, grad mode, autocast...)."""
    return (_describe(args), _describe(kwargs), *context)


def _describe(value: Any) -> Hashable:
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_describe(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _describe(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    return type(value).__qualname__


def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors of a call's arguments, depth first (tuples, lists and plain dicts are
    entered; any other object, e.g. a key-value cache, is opaque)."""
    return list(_tensors(args)) + list(_tensors(kwargs))


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, tuple) or type(value) is list:
        for v in value:
            yield from _tensors(v)
    elif type(value) is dict:
        for v in value.values():
            yield from _tensors(v)


def replaced(
    args: tuple[Any, ...], kwargs: dict[str, Any], subs: dict[int, Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the tensor at each position of :func:`tensors_in` that
    ``subs`` names replaced."""
    count = [0]
    new_args = _replace(args, subs, count)
    return new_args, _replace(kwargs, subs, count)


def _replace(value: Any, subs: dict[int, Tensor], count: list[int]) -> Any:
    if isinstance(value, Tensor):
        k = count[0]
        count[0] += 1
        return subs.get(k, value)
    if isinstance(value, tuple) or type(value) is list:
        items = [_replace(v, subs, count) for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if type(value) is dict:
        return {k: _replace(v, subs, count) for k, v in value.items()}
    return value


class GraphCheck:
    """The walk of :func:`check_graphs`, one root at a time: a micro-batch may walk each value
    that crosses into a later stage when the crossing is made (its producer's graph is whole
    by then, and the walk runs on the consumer's worker), and its outputs at its end. A node
    met again is not walked again, so any order of the same roots finds the same failures.

    Args:
        owner: the stage holding each parameter, by ``id``.
        key: the call's route key (named by :class:`PathChanged`).
    """

    def __init__(self, owner: dict[int, int], key: Hashable) -> None:
        self.owner, self.key = owner, key
        self._seen: dict[Any, int] = {}
        self._below: dict[int, NextNodes] = {}

    def walk(self, tensor: Tensor, stage: int, leaves: dict[int, int]) -> None:
        """Walk back from ``tensor``, a value of ``stage``: every leaf reached must be that
        stage's (``leaves``: the crossing leaves made so far, by ``id``, to the stage they
        enter; else :attr:`owner`) and no node may be one another stage reached."""
        seen, owner = self._seen, self.owner
        below = self._below.setdefault(stage, {})
        stack = [tensor.grad_fn] if tensor.grad_fn is not None else []
        while stack:
            node = stack.pop()
            found = seen.get(node)
            if found is not None:
                if found != stage:
                    raise PathChanged(
                        self.key, f"stage {stage} computes with stage {found}'s values"
                    )
                continue
            seen[node] = stage
            nexts = [c for c, _ in node.next_functions]
            below[node] = nexts
            if not nexts:  # a leaf's accumulator (only those hold a ``variable``) or a source
                variable = getattr(node, "variable", None)
                if variable is not None:
                    holder = leaves.get(id(variable), owner.get(id(variable)))
                    if holder != stage:
                        raise PathChanged(
                            self.key, f"stage {stage} reaches a leaf of stage {holder}"
                        )
                continue
            for nxt in nexts:
                if nxt is not None:
                    stack.append(nxt)

    def walked(self) -> dict[int, NextNodes]:
        """Per stage, the nodes walked with their next nodes: what the stage's backward
        planning would read again (``plan_backward(known=...)``)."""
        return self._below

    def forget(self) -> None:
        """Let go of the nodes walked (the micro-batch's graph lives on without them)."""
        self._seen.clear()
        self._below = {}


def check_graphs(
    roots: Sequence[tuple[Tensor, int]],
    leaves: dict[int, int],
    owner: dict[int, int],
    key: Hashable,
) -> None:
    """Check that each stage's autograd graph is its own: walking back from each root
    ``(tensor, stage)`` (what a stage hands on or returns), every leaf reached is one of that
    stage's (``leaves``: crossing leaves, by ``id``, to the stage they enter; ``owner``: the
    stage holding each parameter) and no node is reached from two stages. Else the call's
    gradients would not reach every stage: :class:`PathChanged`."""
    check = GraphCheck(owner, key)
    for tensor, stage in roots:
        check.walk(tensor, stage, leaves)
