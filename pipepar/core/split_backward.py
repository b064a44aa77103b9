"""Split one stage's backward into B (gradient of the stage input) and W (parameter gradients).

The previous stage waits only for B; W can run later, when the stage would otherwise idle
(zero-bubble schedules). Autograd computes only what the requested inputs need, so
``autograd.grad(outputs, stage_inputs)`` skips every weight-gradient product: that is B. For W we
must restart autograd where the weight paths leave the input path, with the gradients that
reached those places during B.

The graph walk: a node is *on the input path* if a stage input is reachable from it. An input-path
node whose next node leads only to parameters is a *junction* (for ``y = x @ w.T`` the mm node:
one edge goes on to ``x``, one to ``w``). During B a pre-hook on each junction records the
gradient flowing into it; W then runs ``autograd.grad`` from each junction (a
:class:`torch.autograd.graph.GradientEdge`) to the parameters only reachable through it.

If a parameter is reachable from two junctions (a weight used twice in one stage), restarting at
both would count the path between them twice; such a stage runs its whole backward in B and W
does nothing (correct, only without the overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "backward_input"]


@dataclass
class WeightWork:
    """What W needs: per junction, its recorded gradients and the parameters it leads to."""

    junctions: list[tuple[Node, list[Tensor]]] = field(default_factory=list)
    grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)
    roots: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # outputs needing no input
    root_params: list[Tensor] = field(default_factory=list)
    keep: Any = None  # the outputs: they keep the graph alive until W ran

    def run(self) -> list[tuple[Tensor, Tensor]]:
        """Compute the parameter gradients: a list of (parameter, gradient)."""
        found: list[tuple[Tensor, Tensor]] = []
        for k, (node, params) in enumerate(self.junctions):
            grads = self.grads.get(k)
            if grads is None:
                continue
            edges = [(GradientEdge(node, n), g) for n, g in enumerate(grads) if g is not None]
            if edges:
                found += _grad([e for e, _ in edges], params, [g for _, g in edges])
        if self.roots and self.root_params:
            found += _grad([t for t, _ in self.roots], self.root_params, [g for _, g in self.roots])
        self.junctions, self.grads, self.roots, self.keep = [], {}, [], None
        return found


def _grad(outputs: Sequence[Any], params: Sequence[Tensor], grads: Sequence[Tensor]) -> list:
    result = torch.autograd.grad(outputs, params, grads, retain_graph=True, allow_unused=True)
    return [(p, g) for p, g in zip(params, result) if g is not None]


def backward_input(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
) -> tuple[list[Tensor | None], WeightWork | None]:
    """Run B: the gradients of ``inputs``; return them and the W still to run.

    Returns ``None`` for the W when the stage cannot be split (see the module docstring); the
    caller then runs the whole backward itself.
    """
    param_nodes = {_leaf_node(p): p for p in params}
    param_nodes.pop(None, None)
    input_nodes = {_leaf_node(x) for x in inputs} - {None}
    on_path = _input_path([t.grad_fn for t in outputs], input_nodes)
    work = WeightWork(keep=outputs)
    owners: dict[int, int] = {}
    for node in on_path:
        for child, _ in node.next_functions:
            if child is None or child in on_path:
                continue
            reached = _reachable_params(child, param_nodes)
            if reached:
                for p in reached:
                    owners[id(p)] = owners.get(id(p), 0) + 1
                _add_junction(work, node, reached)
    for t, g in zip(outputs, grads):
        if t.grad_fn is None or t.grad_fn not in on_path:
            work.roots.append((t, g))
    for p in _params_of(work.roots, param_nodes):
        work.root_params.append(p)
        owners[id(p)] = owners.get(id(p), 0) + 1
    if any(n > 1 for n in owners.values()):
        return [], None
    handles = [_record(node, k, work) for k, (node, _) in enumerate(work.junctions)]
    try:
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.grad_fn in on_path]
        result: Sequence[Tensor | None] = [None] * len(inputs)
        if pairs and inputs:
            result = torch.autograd.grad(
                [t for t, _ in pairs],
                list(inputs),
                [g for _, g in pairs],
                retain_graph=True,
                allow_unused=True,
            )
    finally:
        for h in handles:
            h.remove()
    return list(result), work


def _add_junction(work: WeightWork, node: Node, params: list[Tensor]) -> None:
    for k, (known, have) in enumerate(work.junctions):
        if known is node:
            ids = {id(p) for p in have}
            work.junctions[k] = (known, have + [p for p in params if id(p) not in ids])
            return
    work.junctions.append((node, params))


def _record(node: Node, k: int, work: WeightWork) -> Any:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        work.grads[k] = tuple(grad_outputs)

    return node.register_prehook(hook)


def _leaf_node(t: Tensor) -> Node | None:
    """The autograd node of a tensor: its grad_fn, or a leaf's gradient accumulator."""
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


def _input_path(roots: Sequence[Node | None], targets: set[Node | None]) -> set[Node]:
    """Nodes reachable from ``roots`` from which a node of ``targets`` is reachable."""
    leads: dict[Node, bool] = {}
    order: list[Node] = []
    stack = [(r, False) for r in roots if r is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            children = [c for c, _ in node.next_functions if c is not None]
            leads[node] = node in targets or any(leads.get(c, False) for c in children)
            order.append(node)
            continue
        if node in leads:
            continue
        leads[node] = False  # visiting
        stack.append((node, True))
        stack += [(c, False) for c, _ in node.next_functions if c is not None and c not in leads]
    return {n for n in order if leads[n]}


def _reachable_params(start: Node, param_nodes: dict[Any, Tensor]) -> list[Tensor]:
    seen, stack, found = {start}, [start], []
    while stack:
        node = stack.pop()
        if node in param_nodes:
            found.append(param_nodes[node])
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return found


def _params_of(
    roots: Sequence[tuple[Tensor, Tensor]], param_nodes: dict[Any, Tensor]
) -> list[Tensor]:
    found: list[Tensor] = []
    for t, _ in roots:
        if t.grad_fn is not None:
            ids = {id(p) for p in found}
            found += [p for p in _reachable_params(t.grad_fn, param_nodes) if id(p) not in ids]
    return found
