"""A stage's backward plans, made once per kind of graph and replayed on the graphs like it.

:func:`~pipepar.core.split_backward.plan_backward` reads a micro-batch's autograd graph and
finds its junctions, direct terms and roots: Python work of the order of the stage's own
arithmetic on small layers, and every micro-batch makes a new graph. The graphs of one stage
are nearly always alike, node for node: what the plan decides depends on the graph's shape
(each node's kind and next nodes, which leaves are parameters and which inputs, which
parameters carry hooks), not on the tensors' values. :class:`BackwardPlans` reads each
graph's shape (one pass over its nodes, the cheapest part of planning) as a key; a graph of a
shape seen before gets the plan made for it, its nodes and saved tensors taken from the new
graph by position. What a plan reads of the saved tensors beyond the shape (each direct term's
saved input: kept, dense, of its parameter's dtype and device) is checked again on each graph;
if a check fails, the graph is planned afresh. A graph of another shape (a branch taken on
this micro-batch and not the last) is planned afresh too, and its plan kept beside the others.

A plan keeps no node and no tensor of the graph it was made on (only positions, and the
stage's parameters), so it keeps nothing alive past the micro-batch, and a stage keeps its
plans from one mini-batch to the next (:func:`plans_over`): a step replays the last step's
plans instead of making each one again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.autograd.graph import Node

from pipepar.core.split_backward import (
    _ACCUMULATE,
    _NAMES,
    BackwardWalk,
    Direct,
    NextNodes,
    NormSaved,
    ScaleSaved,
    WeightWork,
    _name,
    _plain_product,
    _saved_input,
    fits,
    norm_saved,
    plan_backward,
    scale_operand,
)

__all__ = ["BackwardPlans", "graph_shape", "plans_over"]

_KEPT = 16
"""Shapes of graph whose plans a stage keeps (the oldest is dropped beyond that)."""


@dataclass(frozen=True)
class _Term:
    """A :class:`~pipepar.core.split_backward.Direct` term by position: ``kind`` says what it
    reads of its junction's node (``"product"``: the saved left operand; ``"bias"``: nothing;
    ``"norm"``: a LayerNorm's saved values; ``"scale"``: the other operand of a product)."""

    param: Tensor
    junction: int
    kind: str
    transposed: bool
    edge: int
    cast: bool
    name: str
    """The junction node's name (which saved input a product reads)."""


@dataclass(frozen=True)
class _Plan:
    """A :class:`~pipepar.core.split_backward.BackwardWalk` with each node as its position in
    :func:`graph_shape`'s order and each output as its index."""

    junctions: tuple[tuple[int, tuple[Tensor, ...]], ...]
    terms: tuple[_Term, ...]
    roots: tuple[int, ...]
    root_params: tuple[Tensor, ...]
    on_path: tuple[int, ...]
    captured: tuple[int, ...]
    conflict: bool


def graph_shape(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    params: dict[int, Tensor],
    known: NextNodes | None = None,
) -> tuple[tuple[Any, ...], list[Node]]:
    """The shape of the graph behind ``outputs`` as a hashable key, and its nodes in the
    order the key lists them (depth first, next nodes in order).

    The key lists each node once, when first reached: its name, its number of next nodes and,
    for a gradient accumulator, which leaf it feeds (a parameter of ``params`` by ``id``, with
    whether it carries a tensor hook; an input; another leaf); a node reached again is its
    position. Two graphs have one key exactly when their nodes correspond one to one with the
    same names, next nodes, leaves and inputs. ``known``: next nodes read earlier."""
    input_leaves = {id(t) for t in inputs if t.requires_grad and t.grad_fn is None}
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    key: list[Any] = [len(outputs)]
    add, kinds, read = key.append, _NAMES, known or {}
    # Edges as autograd lists them, (node, input number); each node's read once.
    stack = [iter([(t.grad_fn, 0) for t in outputs])]
    while stack:
        for node, _ in stack[-1]:
            if node is None:
                add(-1)
                continue
            at = index.get(node)
            if at is not None:
                add(at)
                continue
            index[node] = len(nodes)
            nodes.append(node)
            name = kinds.get(type(node)) or _name(node)
            below = read.get(node) if read else None
            edges = node.next_functions if below is None else [(c, 0) for c in below]
            add(name)
            add(len(edges))
            if name == _ACCUMULATE:
                add(_leaf(node.variable, params, input_leaves))  # type: ignore[attr-defined]
            elif edges:
                stack.append(iter(edges))
                break
        else:
            stack.pop()
    key.append(tuple(-1 if t.grad_fn is None else index.get(t.grad_fn, -1) for t in inputs))
    return tuple(key), nodes


def _leaf(variable: Tensor, params: dict[int, Tensor], inputs: set[int]) -> Any:
    key = id(variable)
    if key in params:
        return (key, bool(variable._backward_hooks))
    return "input" if key in inputs else "leaf"


class BackwardPlans:
    """The backward plans of one stage's graphs, by their shape.

    Args:
        params: the stage's parameters that take a gradient, by ``id``
            (:func:`~pipepar.core.split_backward.by_id`).

    Example:
        >>> import torch
        >>> from pipepar.core.split_backward import by_id
        >>> layer = torch.nn.Linear(2, 2)
        >>> plans = BackwardPlans(by_id(list(layer.parameters())))
        >>> for _ in range(2):
        ...     x = torch.ones(1, 2, requires_grad=True)
        ...     y = layer(x)
        ...     walk = plans.plan([y], [torch.ones(1, 2)], [x])
        >>> plans.made, len(walk.work.direct)
        (1, 2)
    """

    def __init__(self, params: dict[int, Tensor]) -> None:
        self.params = params
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._lock = threading.Lock()
        self.made = 0
        """Plans made by reading a whole graph (the others were replayed)."""

    def over(self, params: dict[int, Tensor]) -> bool:
        """Whether these plans are over exactly ``params`` (by ``id``; the plans hold the
        parameters, so an ``id`` is never another tensor's while they are kept)."""
        mine = self.params
        return len(params) == len(mine) and all(mine.get(k) is p for k, p in params.items())

    def __getstate__(self) -> dict[str, Any]:
        """A copy plans afresh over the copied parameters (the plans name the originals)."""
        return {"params": list(self.params.values())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        BackwardPlans.__init__(self, {id(p): p for p in state["params"]})

    def plan(
        self,
        outputs: Sequence[Tensor],
        grads: Sequence[Tensor],
        inputs: Sequence[Tensor],
        *,
        reach: bool = False,
        known: NextNodes | None = None,
    ) -> BackwardWalk:
        """:func:`~pipepar.core.split_backward.plan_backward` of this graph (same
        arguments), replayed from a graph of the same shape where one was planned."""
        shape, nodes = graph_shape(outputs, inputs, self.params, known)
        key = (reach, shape)
        kept = self._plans.get(key)
        if kept is not None:
            walk = _replay(kept, nodes, outputs, grads)
            if walk is not None:
                return walk
        walk = plan_backward(outputs, grads, inputs, self.params, reach=reach, known=known)
        kept = _positions(walk, nodes, outputs)
        with self._lock:  # a stage's W may plan on another worker while its B plans
            self.made += 1
            if len(self._plans) >= _KEPT:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = kept
        return walk


def plans_over(kept: BackwardPlans | None, params: dict[int, Tensor]) -> BackwardPlans:
    """``kept`` if it plans over exactly ``params`` (:meth:`BackwardPlans.over`), else new
    plans over them: a stage keeps its plans from one mini-batch to the next, and starts
    afresh when the parameters that take a gradient change (one frozen, one replaced)."""
    return kept if kept is not None and kept.over(params) else BackwardPlans(params)


def _positions(walk: BackwardWalk, nodes: list[Node], outputs: Sequence[Tensor]) -> _Plan:
    """``walk`` with its nodes as positions in ``nodes``."""
    at = {node: k for k, node in enumerate(nodes)}
    work = walk.work
    roots = {id(t) for t, _ in work.roots}
    return _Plan(
        junctions=tuple((at[node], tuple(params)) for node, params in work.junctions),
        terms=tuple(_term(d, work.junctions[d.junction][0]) for d in work.direct),
        roots=tuple(j for j, t in enumerate(outputs) if id(t) in roots),
        root_params=tuple(work.root_params),
        on_path=tuple(at[node] for node in walk.on_path),
        captured=tuple(walk.captured),
        conflict=walk.conflict,
    )


def _term(d: Direct, node: Node) -> _Term:
    """Direct term ``d`` of junction ``node`` by position."""
    if isinstance(d.kernel, NormSaved):
        kind = "norm"
    elif isinstance(d.kernel, ScaleSaved):
        kind = "scale"
    else:
        kind = "bias" if d.saved is None else "product"
    name = _NAMES.get(type(node)) or _name(node)
    return _Term(d.param, d.junction, kind, d.transposed, d.edge, d.cast, name)


def _replay(
    plan: _Plan, nodes: list[Node], outputs: Sequence[Tensor], grads: Sequence[Tensor]
) -> BackwardWalk | None:
    """``plan`` on a graph of its shape (``nodes`` in :func:`graph_shape`'s order); ``None``
    if a direct term cannot read what it needs there."""
    junctions = [(nodes[k], list(params)) for k, params in plan.junctions]
    direct: list[Direct] = []
    saved: dict[int, Tensor | NormSaved | ScaleSaved | None] = {}  # each junction's, read once
    for t in plan.terms:
        if t.kind == "bias":
            direct.append(Direct(t.param, t.junction, None, t.transposed, cast=t.cast))
            continue
        what = saved.get(t.junction)
        if what is None:
            what = saved[t.junction] = _read(junctions[t.junction][0], t)
        if what is None or not fits(t.param, t.cast, _computes_with(what)):
            return None
        if isinstance(what, Tensor):  # a product's saved input
            direct.append(Direct(t.param, t.junction, what, t.transposed, cast=t.cast))
        else:
            direct.append(Direct(t.param, t.junction, None, False, kernel=what, edge=t.edge))
    work = WeightWork(
        junctions=junctions,
        roots=[(outputs[j], grads[j]) for j in plan.roots],
        root_params=list(plan.root_params),
        keep=outputs,
        direct=direct,
    )
    on_path = {nodes[k] for k in plan.on_path}
    return BackwardWalk(work, on_path, list(plan.captured), plan.conflict)


def _read(node: Node, t: _Term) -> Tensor | NormSaved | ScaleSaved | None:
    """What term ``t`` reads of ``node``, if it is there and of the kind it was planned on."""
    if t.kind == "product":
        x = _saved_input(node, t.name)
        return x if x is not None and _plain_product(node, t.name, x) else None
    if t.kind == "norm":
        return norm_saved(node)
    other = scale_operand(node, t.edge)
    return None if other is None else ScaleSaved(other, t.param.shape)


def _computes_with(saved: Tensor | NormSaved | ScaleSaved) -> Tensor:
    """The tensor whose dtype and device a term computes in."""
    if isinstance(saved, NormSaved):
        return saved.input
    return saved.other if isinstance(saved, ScaleSaved) else saved
