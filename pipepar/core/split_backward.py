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

**Direct gradients.** Restarting autograd costs a pass of the engine per junction and keeps the
graph alive until W; for the commonest junction, a matrix product with a weight (``nn.Linear``:
an ``addmm`` or ``mm`` node whose weight edge goes through a transpose straight to the
parameter), the weight gradient is one product of what autograd saved anyway, ``grad^T @ input``,
and the bias gradient ``grad.sum(0)``. Such a parameter is a :class:`Direct` term: W computes it
from the saved input and the recorded gradient, summing into the running sum in the same
product (``addmm_``), without re-entering autograd. Every other parameter keeps the generic
route, and so does a parameter that is also reached along any generic path, or that carries a
tensor hook. A LayerNorm's weight and bias are direct terms of a split too: W runs the norm's own
backward kernel (``native_layer_norm_backward``, asked for those two outputs, as autograd does)
on what the node saved, instead of an autograd pass from the node (a third of its cost); so is a
parameter scaling a tensor elementwise (an RMSNorm written in Python, ``weight * normalized``):
``grad * normalized`` summed to the weight's shape, as autograd computes it. When no generic work
is left, B does not retain the graph.

:func:`backward_whole` uses the same terms for an unsplit backward: one engine pass for the input
and the generic parameters, each direct term computed the moment its gradient arrives. There the
junctions with direct terms are targets of the pass too (``plan_backward(reach=True)``), so a
first stage, whose input needs no gradient, still reaches its Linears; the lowest of them is
*captured*: its gradient comes back from ``autograd.grad`` without running the node.

If a parameter is reachable from two junctions (a weight used twice in one stage), restarting at
both would count the path between them twice; such a stage runs its whole backward in B and W
does nothing (correct, only without the overlap). So does a stage whose parameters are reached
through a region compiled by ``torch.compile``: its backward node computes the region's input
and parameter gradients in one graph, which W would run a second time, and whose buffers its
first run may free (AOTAutograd's donated buffers refuse a pass that keeps the graph).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from pipepar.core import engine
from pipepar.core.grad_mode import GradMode

__all__ = [
    "CAST",
    "TRANSPOSE",
    "Adder",
    "Direct",
    "NextNodes",
    "Params",
    "BackwardWalk",
    "WeightWork",
    "backward_input",
    "backward_whole",
    "by_id",
    "fits",
    "norm_saved",
    "plan_backward",
    "run_input",
    "scale_operand",
]

_MATMUL = {"AddmmBackward0": (1, 2, 0), "MmBackward0": (0, 1, None)}
_RUNS_ONCE = frozenset({"CompiledFunctionBackward"})
"""Nodes whose backward computes every gradient of a region at once and must not run twice."""
"""Node name: indices of (input, weight, bias) among its next edges."""
_NORM = "NativeLayerNormBackward0"
"""A LayerNorm: next edges (input, weight, bias)."""
_SCALE = "MulBackward0"
"""An elementwise product of two tensors: next edges (self, other)."""
_TERMS = frozenset((*_MATMUL, _NORM, _SCALE))
"""The nodes that may have direct terms."""
_ACCUMULATE = "torch::autograd::AccumulateGrad"
CAST = "ToCopyBackward0"
"""A ``Tensor.to`` of a parameter (autocast's copy of a weight in the lower precision)."""
TRANSPOSE = "TBackward0"
"""A transpose (``nn.Linear`` multiplies by its weight's)."""
_NAMES: dict[type, str] = {}
"""Node names by the node's Python type, for the types named after their node (asking a node
builds a new string each time)."""


def _name(node: Node) -> str:
    kind = type(node)
    name = _NAMES.get(kind)
    if name is None:
        name = node.name()
        if name.rpartition("::")[2] == kind.__name__:  # not a type several kinds share
            _NAMES[kind] = name
    return name


@dataclass(frozen=True)
class NormSaved:
    """What a LayerNorm's backward node saved: W computes its weight's and bias's gradients
    with the norm's own backward kernel (the one autograd runs, asked for those outputs only),
    with no autograd pass."""

    input: Tensor
    shape: list[int]
    mean: Tensor
    rstd: Tensor
    weight: Tensor | None
    bias: Tensor | None

    def grad(self, grad: Tensor, edge: int) -> Tensor:
        """The gradient of the parameter on next edge ``edge`` (1: weight, 2: bias)."""
        mask = [False, edge == 1, edge == 2]
        out = torch.ops.aten.native_layer_norm_backward(
            grad, self.input, self.shape, self.mean, self.rstd, self.weight, self.bias, mask
        )
        return out[edge]

    def kept(self) -> list[Tensor]:
        return [self.input, self.mean, self.rstd]


@dataclass(frozen=True)
class ScaleSaved:
    """The other operand of an elementwise product with a parameter (an RMSNorm's
    ``weight * normalized``): the parameter's gradient is ``grad * other`` summed to the
    parameter's shape, the very ops autograd runs."""

    other: Tensor
    shape: torch.Size

    def grad(self, grad: Tensor, edge: int) -> Tensor:
        """The parameter's gradient (``edge``, its side of the product, changes nothing)."""
        return (grad * self.other).sum_to_size(self.shape)

    def kept(self) -> list[Tensor]:
        return [self.other]


@dataclass
class Direct:
    """One parameter gradient of a junction, computed without autograd.

    ``saved`` is a matrix product's left operand (the layer input, 2-D); ``None`` marks a term
    that is no product: a bias, whose gradient is the incoming gradient summed over rows, or a
    :attr:`kernel` term. ``transposed`` says the parameter entered as ``param.t()``
    (``nn.Linear``): its gradient is ``grad^T @ saved``, else ``saved^T @ grad``. Both are the
    very products autograd would make, so the first term equals autograd's bit for bit; later
    ones are summed into the running sum by the product itself.
    """

    param: Tensor
    junction: int
    saved: Tensor | None
    transposed: bool = True
    kernel: NormSaved | ScaleSaved | None = None
    """For a LayerNorm's weight or bias, or a parameter scaling a tensor elementwise (``saved``
    is None): what the node saved, and how its gradient is made of it."""
    edge: int = 0
    """The node's next edge of the parameter."""
    cast: bool = False
    """The parameter entered as a copy in another dtype (autocast's, of a float32 weight): the
    product is made in the copy's dtype and cast to the parameter's, as autograd does."""

    def add(self, grad: Tensor, total: Tensor | None, owned: bool) -> Tensor:
        """``total + this gradient``: in place into ``total`` if ``owned``, else a new tensor."""
        if self.saved is None:
            part = grad.sum(0) if self.kernel is None else self.kernel.grad(grad, self.edge)
        else:
            a, b = (grad.t(), self.saved) if self.transposed else (self.saved.t(), grad)
            if not self.cast:  # the product adds into the sum itself
                if total is None:
                    return torch.mm(a, b)
                return total.addmm_(a, b) if owned else torch.addmm(total, a, b)
            part = torch.mm(a, b)
        if self.cast:
            part = part.to(self.param.dtype)
        if total is None:
            return part
        return total.add_(part) if owned else total + part

    def kept(self) -> list[Tensor]:
        """What the term reads of the forward (kept until W runs)."""
        if self.kernel is not None:
            return self.kernel.kept()
        return [] if self.saved is None else [self.saved]


Adder = Callable[[Direct, Tensor | None], None]
"""``add(term, grad)``: sum ``term``'s gradient made from ``grad`` (``None``: none arrived)."""

Params = Sequence[Tensor] | dict[int, Tensor]
"""The parameters of a backward: as they are, or :func:`by_id`."""

NextNodes = dict[Node, list[Node | None]]
"""Nodes of a graph with their next nodes, as an earlier walk of the same graph read them
(``[n for n, _ in node.next_functions]``; a node's next edges never change once it exists)."""


def by_id(params: Sequence[Tensor]) -> dict[int, Tensor]:
    """``params`` that take a gradient, by ``id`` (how the walk recognises their leaves)."""
    return {id(p): p for p in params if p.requires_grad}


@dataclass
class WeightWork:
    """What W needs: per junction, its recorded gradients and the parameters it leads to."""

    junctions: list[tuple[Node, list[Tensor]]] = field(default_factory=list)
    grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)
    roots: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # outputs needing no input
    root_params: list[Tensor] = field(default_factory=list)
    keep: Any = None  # the outputs: they keep the graph alive until W ran
    direct: list[Direct] = field(default_factory=list)

    def generic(self) -> bool:
        """True if some parameter needs autograd again in W."""
        return any(params for _, params in self.junctions) or bool(self.roots and self.root_params)

    def generic_params(self) -> list[Tensor]:
        """The parameters :meth:`run` computes, each once."""
        found: dict[int, Tensor] = {}
        for _, params in self.junctions:
            found.update((id(p), p) for p in params)
        if self.roots:
            found.update((id(p), p) for p in self.root_params)
        return list(found.values())

    def run(self) -> list[tuple[Tensor, Tensor]]:
        """Compute the generic parameter gradients: a list of (parameter, gradient); the
        caller computes the :attr:`direct` terms (see :meth:`run_direct`)."""
        found: list[tuple[Tensor, Tensor]] = []
        for k, (node, params) in enumerate(self.junctions):
            grads = self.grads.get(k)
            if grads is None or not params:
                continue
            edges = [(GradientEdge(node, n), g) for n, g in enumerate(grads) if g is not None]
            if edges:
                found += _grad([e for e, _ in edges], params, [g for _, g in edges])
        if self.roots and self.root_params:
            found += _grad([t for t, _ in self.roots], self.root_params, [g for _, g in self.roots])
        self.junctions, self.roots, self.keep = [], [], None
        return found

    def run_direct(self, add: Adder) -> None:
        """Hand every direct term and its recorded gradient to ``add``; then forget them."""
        with GradMode(False):  # the saved inputs are part of the graph: record nothing
            for term in self.direct:
                grads = self.grads.get(term.junction)
                add(term, grads[0] if grads else None)
        self.direct, self.grads = [], {}


def _grad(outputs: Sequence[Any], params: Sequence[Tensor], grads: Sequence[Tensor]) -> list:
    result = torch.autograd.grad(outputs, params, grads, retain_graph=True, allow_unused=True)
    return [(p, g) for p, g in zip(params, result) if g is not None]


@dataclass
class BackwardWalk:
    """The graph walk of one micro-batch's backward: what B and W (or one pass) do.

    Attributes:
        work: junctions (with their generic parameters), direct terms, roots.
        on_path: nodes from which a stage input or a direct junction is reachable.
        captured: junction indices whose gradient B takes as an output (nodes it need not run).
        conflict: the backward cannot be split: a parameter is reached along two routes, or
            W would run again a junction whose backward runs once (a compiled region's).
    """

    work: WeightWork
    on_path: set[Node]
    captured: list[int]
    conflict: bool

    def direct_params(self) -> list[Tensor]:
        """The parameters computed as direct terms, each once."""
        seen: dict[int, Tensor] = {}
        for term in self.work.direct:
            seen.setdefault(id(term.param), term.param)
        return list(seen.values())


def plan_backward(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor],
    inputs: Sequence[Tensor],
    params: Params,
    *,
    reach: bool = False,
    known: NextNodes | None = None,
) -> BackwardWalk:
    """Walk the graph from ``outputs`` (with incoming ``grads``): junctions, direct terms,
    roots (see the module docstring). Runs nothing. ``params``: the parameters whose
    gradients are wanted, or :func:`by_id` of them (a caller planning every micro-batch's
    backward builds that once). ``known``: nodes whose next nodes were read already (the walk
    reads the others' itself).

    With ``reach``, B also propagates to every direct junction, not only to the inputs: for a
    whole backward (:func:`backward_whole`). A split keeps B on the input path, so the generic
    routes are the ones a plain split would take (making a first stage's B reach its Linears
    would cut its one generic route, the whole backward, into several that may share a
    parameter below them, and the stage could not split).
    """
    graph = _Graph(outputs, inputs, params, known)
    hooked = {id(p) for p in graph.params.values() if p._backward_hooks}
    # A split looks for products on the input path; a whole backward (reach) at every one,
    # so it walks the path once, with them.
    on_path, needed = (set(), set()) if reach else graph.input_path(set())
    candidates = {}
    for node, name in graph.products:
        if name not in _MATMUL:  # a whole backward runs the node anyway: its weights come free
            found = None if reach or node not in on_path else _kernel_edges(graph, node, hooked)
        elif reach or node in on_path:
            found = _direct_edges(graph, node, name, hooked)
        else:
            continue
        if found is not None:
            candidates[node] = found
    if reach:
        on_path, needed = graph.input_path(set(candidates))
    work = WeightWork(keep=outputs)
    routes: Counter[int] = Counter()
    generic: set[int] = set(hooked)
    pending = _junctions(work, graph, on_path, candidates, routes, generic)
    for t, g in zip(outputs, grads):
        if t.grad_fn is None or t.grad_fn not in on_path:
            work.roots.append((t, g))
    for p in graph.reachable_params([t.grad_fn for t, _ in work.roots]):
        work.root_params.append(p)
        routes[id(p)] += 1
        generic.add(id(p))
    _settle(work, pending, generic)
    captured = [k for k, (node, _) in enumerate(work.junctions) if node not in needed]
    twice = any(n > 1 for n in routes.values())
    return BackwardWalk(work, on_path, captured, twice or _runs_once(work, graph.names))


def _runs_once(work: WeightWork, names: dict[Node, str]) -> bool:
    """Whether W would run again a junction whose backward runs once: a compiled region's
    (``torch.compile``: one graph computes its input and parameter gradients together, and
    its saved buffers may be freed by the first run, so it refuses a pass that keeps it)."""
    return any(params and names.get(node) in _RUNS_ONCE for node, params in work.junctions)


class _Graph:
    """The nodes reachable from ``outputs`` in post order (each after every node reachable
    from it), their next nodes and names (read once: each read builds new Python objects),
    the matrix products among them (:data:`_MATMUL`), the gradient accumulators of ``params``
    and the nodes of ``inputs``. Leaves are recognised by their accumulator's ``variable``
    (asking a leaf for its accumulator costs a view per tensor)."""

    def __init__(
        self,
        outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
        params: Params,
        known: NextNodes | None = None,
    ) -> None:
        self.inputs: set[Node] = {t.grad_fn for t in inputs if t.grad_fn is not None}
        self.params: dict[Node, Tensor] = {}
        self.names: dict[Node, str] = {}
        self.nexts: dict[Node, list[Node | None]] = {}
        self.order: list[Node] = []
        self.products: list[tuple[Node, str]] = []
        starts = [t.grad_fn for t in outputs if t.grad_fn is not None]
        self._walk(starts, params, inputs, known if known is not None else {})

    def _walk(
        self, starts: list[Node], params: Params, inputs: Sequence[Tensor], known: NextNodes
    ) -> None:
        """Visit every node reachable from ``starts`` once, depth first and each node's next
        nodes last to first (the order of a stack they are all pushed onto), appending each
        to :attr:`order` after every node below it. The stack holds (node, its next nodes
        left to enter, last first)."""
        param_ids = params if isinstance(params, dict) else by_id(params)
        input_ids = {id(t) for t in inputs if t.requires_grad and t.grad_fn is None}
        nexts, order = self.nexts, self.order
        visit = self._visitor(param_ids, input_ids, known)
        for start in reversed(starts):
            if start in nexts:
                continue
            stack = [(start, reversed(visit(start)))]
            while stack:
                node, below = stack[-1]
                for child in below:
                    if child is not None and child not in nexts:
                        stack.append((child, reversed(visit(child))))
                        break
                else:
                    stack.pop()
                    order.append(node)

    def _visitor(
        self, param_ids: dict[int, Tensor], input_ids: set[int], known: NextNodes
    ) -> Callable[[Node], list[Node | None]]:
        """``visit(node)``: read ``node``'s next nodes (unless ``known``) and name (once);
        note a parameter's or an input's accumulator and a matrix product. (A closure over
        what it fills: the walk calls it for every node.)"""
        nexts, names, params, products = self.nexts, self.names, self.params, self.products
        inputs, kinds = self.inputs, _NAMES

        def visit(node: Node) -> list[Node | None]:
            below = known.get(node)
            if below is None:
                below = [c for c, _ in node.next_functions]
            name = kinds.get(type(node)) or _name(node)
            nexts[node] = below
            names[node] = name
            if below:
                if name in _TERMS:
                    products.append((node, name))
            elif name == _ACCUMULATE:
                key = id(node.variable)  # type: ignore[attr-defined]
                if key in param_ids:
                    params[node] = param_ids[key]
                elif key in input_ids:
                    inputs.add(node)
            return below

        return visit

    def input_path(self, direct: set[Node]) -> tuple[set[Node], set[Node]]:
        """The nodes from which an input or a ``direct`` junction is reachable (on the path),
        and those B must run: from which one is reachable through a next edge."""
        leads: set[Node] = set()
        needed: set[Node] = set()
        inputs, nexts = self.inputs, self.nexts
        for node in self.order:
            below = False
            for child in nexts[node]:
                if child in leads:
                    below = True
                    break
            if below or node in inputs:
                needed.add(node)
                leads.add(node)
            elif node in direct:
                leads.add(node)
        return leads, needed

    def reachable_params(self, starts: Sequence[Node | None]) -> list[Tensor]:
        """The parameters reachable from ``starts``, each once."""
        seen = {s for s in starts if s is not None}
        stack, found = list(seen), []
        while stack:
            node = stack.pop()
            if node in self.params:
                found.append(self.params[node])
            for child in self.nexts[node]:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)
        return found


_Edge = tuple[Tensor, bool, bool]
"""A direct edge's parameter, whether it enters transposed, and whether through a cast of its
dtype (autocast's copy of a float32 weight): see :class:`Direct`."""

_Candidate = tuple[dict[int, _Edge], "Tensor | NormSaved | ScaleSaved", int | None]
"""A node's direct edges ``{edge: (param, transposed, cast)}``, what its terms read (a matrix
product's saved input, a norm's :class:`NormSaved`) and the index of a product's bias edge."""


_NO_EDGES: tuple[dict[int, _Edge], None, None] = ({}, None, None)
"""What a node without direct edges has of a :data:`_Candidate` (never written to)."""


def _junctions(
    work: WeightWork,
    graph: _Graph,
    on_path: set[Node],
    candidates: dict[Node, _Candidate],
    routes: Counter[int],
    generic: set[int],
) -> list[tuple[int, int, _Edge, Tensor | NormSaved | ScaleSaved | None]]:
    """Add every junction to ``work`` with its generic parameters; count each parameter's
    routes; return the direct edges as (junction, edge, its :data:`_Edge`, saved)."""
    index: dict[Node, int] = {}
    pending: list[tuple[int, int, _Edge, Tensor | NormSaved | ScaleSaved | None]] = []
    nexts, none = graph.nexts, _NO_EDGES
    for node in graph.order:
        if node not in on_path:
            continue
        edges, saved, bias = candidates.get(node) or none
        for n, child in enumerate(nexts[node]):
            if child is None or child in on_path:
                continue
            if n in edges:
                param = edges[n][0]
                k = _junction(work, index, node, [])
                pending.append((k, n, edges[n], None if n == bias else saved))
                routes[id(param)] += 1
                continue
            reached = graph.reachable_params([child])
            if reached:
                _junction(work, index, node, reached)
                for p in reached:
                    routes[id(p)] += 1
                    generic.add(id(p))
    return pending


def _settle(
    work: WeightWork,
    pending: list[tuple[int, int, _Edge, Tensor | NormSaved | ScaleSaved | None]],
    generic: set[int],
) -> None:
    """Make each pending direct edge a :class:`Direct` term, or, if its parameter is reached
    along a generic route too (or is hooked), a generic junction parameter: a parameter is
    either all direct or all generic, so one pass never counts an edge twice."""
    for k, edge, (param, transposed, cast), saved in pending:
        have = work.junctions[k][1]
        if id(param) in generic:
            if all(p is not param for p in have):
                have.append(param)
            continue
        if isinstance(saved, (NormSaved, ScaleSaved)):
            work.direct.append(Direct(param, k, None, False, kernel=saved, edge=edge))
        else:
            work.direct.append(Direct(param, k, saved, transposed, cast=cast))


def _junction(work: WeightWork, index: dict[Node, int], node: Node, params: list[Tensor]) -> int:
    """The index of ``node``'s junction, made if new; ``params`` join its generic parameters."""
    k = index.get(node)
    if k is None:
        index[node] = k = len(work.junctions)
        work.junctions.append((node, list(params)))
        return k
    have = work.junctions[k][1]
    ids = {id(p) for p in have}
    have += [p for p in params if id(p) not in ids]
    return k


def _direct_edges(graph: _Graph, node: Node, name: str, hooked: set[int]) -> _Candidate | None:
    """The edges of a matrix-product node whose gradient is one product of saved values (a
    weight entering as itself or transposed, a 1-D bias); ``None`` if there are none."""
    _, weight, bias = _MATMUL[name]
    x = _saved_input(node, name)
    if x is None or not _plain_product(node, name, x):
        return None
    k, n = (int(d) for d in node._saved_mat2_sym_sizes)  # type: ignore[attr-defined]
    nexts = graph.nexts[node]
    found: dict[int, _Edge] = {}
    child = nexts[weight]
    if child is not None and graph.names[child] == TRANSPOSE:
        under = graph.nexts[child]
        param, cast = _param_under(graph, under[0]) if len(under) == 1 else (None, False)
        if param is not None and param.shape == (n, k):
            found[weight] = (param, True, cast)
    else:
        param, cast = _param_under(graph, child)
        if param is not None and param.shape == (k, n):
            found[weight] = (param, False, cast)
    if bias is not None:
        param, cast = _param_under(graph, nexts[bias])
        if param is not None and param.shape == (n,):
            found[bias] = (param, False, cast)
    found = _usable(found, x, hooked)
    return (found, x, bias) if found else None


def _kernel_edges(graph: _Graph, node: Node, hooked: set[int]) -> _Candidate | None:
    """A LayerNorm's or an elementwise product's direct edges (see :func:`_norm_edges`,
    :func:`_scale_edges`)."""
    if graph.names[node] == _NORM:
        return _norm_edges(graph, node, hooked)
    return _scale_edges(graph, node, hooked)


def _scale_edges(graph: _Graph, node: Node, hooked: set[int]) -> _Candidate | None:
    """The parameter edge of an elementwise product of a parameter (as it is: an RMSNorm's
    weight) and another tensor, with that tensor as the product saved it; ``None`` if the
    product is of anything else."""
    nexts = graph.nexts[node]
    params = [(e, graph.params[c]) for e, c in enumerate(nexts) if c in graph.params]
    if len(nexts) != 2 or len(params) != 1:
        return None
    edge, param = params[0]
    other = scale_operand(node, edge)
    if other is None:
        return None
    found = _usable({edge: (param, False, False)}, other, hooked)
    return (found, ScaleSaved(other, param.shape), None) if found else None


def _norm_edges(graph: _Graph, node: Node, hooked: set[int]) -> _Candidate | None:
    """A LayerNorm node's weight and bias edges (parameters as they are, on the input's dtype
    and device, without tensor hooks) and what its backward saved; ``None`` if none."""
    saved = norm_saved(node)
    if saved is None:
        return None
    nexts = graph.nexts[node]
    edges = {
        e: (graph.params[nexts[e]], False, False)  # type: ignore[index]
        for e in (1, 2)
        if len(nexts) > e and nexts[e] in graph.params
    }
    found = _usable(edges, saved.input, hooked)
    return (found, saved, None) if found else None


def scale_operand(node: Node, edge: int) -> Tensor | None:
    """The other operand an elementwise product saved for its operand on next edge ``edge``,
    if it kept a dense real tensor (``None``: freed, or of another kind)."""
    try:
        other = getattr(node, "_saved_other" if edge == 0 else "_saved_self")
    except (AttributeError, RuntimeError):  # freed, or another version's node
        return None
    if not isinstance(other, Tensor) or other.layout != torch.strided or other.is_complex():
        return None
    return other


def norm_saved(node: Node) -> NormSaved | None:
    """What a LayerNorm's backward node saved (``None``: freed, or another version's node)."""
    try:
        return NormSaved(
            node._saved_input,  # type: ignore[attr-defined]
            [int(d) for d in node._saved_normalized_shape],  # type: ignore[attr-defined]
            node._saved_result1,  # type: ignore[attr-defined]
            node._saved_result2,  # type: ignore[attr-defined]
            node._saved_weight,  # type: ignore[attr-defined]
            node._saved_bias,  # type: ignore[attr-defined]
        )
    except (AttributeError, RuntimeError):
        return None


def fits(param: Tensor, cast: bool, x: Tensor) -> bool:
    """Whether a direct term of ``param`` may compute with ``x``: on its device, and of its
    dtype unless the parameter enters through a cast."""
    return (cast or param.dtype == x.dtype) and param.device == x.device


def _param_under(graph: _Graph, node: Node | None) -> tuple[Tensor | None, bool]:
    """The parameter whose accumulator ``node`` is, or is the only next node of: a copy of
    the parameter in another dtype (autocast casts a float32 weight once and computes with
    the copy); and whether it is such a copy."""
    param = graph.params.get(node) if node is not None else None
    if param is not None or node is None or graph.names[node] != CAST:
        return param, False
    under = graph.nexts[node]
    return (graph.params.get(under[0]) if len(under) == 1 and under[0] else None), True


def _usable(edges: dict[int, _Edge], x: Tensor, hooked: set[int]) -> dict[int, _Edge]:
    """The direct edges whose parameter carries no tensor hook and has the device of what the
    term computes with (``x``), and its dtype unless it enters through a cast."""
    return {
        e: (p, t, cast)
        for e, (p, t, cast) in edges.items()
        if id(p) not in hooked and fits(p, cast, x)
    }


def _plain_product(node: Node, name: str, x: Tensor) -> bool:
    """A real, dense, unscaled 2-D product (``alpha = beta = 1``) of a saved strided input."""
    scaled = getattr(node, "_saved_alpha", 1) != 1 or getattr(node, "_saved_beta", 1) != 1
    if name == "AddmmBackward0" and scaled:
        return False
    return (
        x.dim() == 2 and x.layout == torch.strided and x.is_floating_point() and not x.is_complex()
    )


def _saved_input(node: Node, name: str) -> Tensor | None:
    """The left operand a matrix-product node saved (``None`` if it did not save it)."""
    try:
        return getattr(node, "_saved_mat1" if name == "AddmmBackward0" else "_saved_self", None)
    except RuntimeError:  # freed (a graph run without retain_graph)
        return None


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
    return run_input(plan_backward(outputs, grads, inputs, params), outputs, grads, inputs)


def run_input(
    plan: BackwardWalk, outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]
) -> tuple[list[Tensor | None], WeightWork | None]:
    """B of a :func:`plan_backward` plan (see :func:`backward_input`)."""
    if plan.conflict:
        return [], None
    work = plan.work
    retain = work.generic()
    if not retain:
        work.keep = None
    # Phase 1: a pre-hook on each junction the pass runs records the gradient reaching it; a
    # junction it need not run is a target of the pass instead (captured).
    captured = plan.captured
    record = work.grads.__setitem__
    handles = [
        node.register_prehook(functools.partial(record, k))
        for k, (node, _) in enumerate(work.junctions)
        if k not in captured
    ]
    edges = [GradientEdge(work.junctions[k][0], 0) for k in captured]
    targets: Sequence[Tensor | GradientEdge] = [*inputs, *edges] if edges else inputs
    # Phase 2: one engine pass from the outputs on the input path.
    on_path = plan.on_path
    outs: list[Tensor] = []
    gouts: list[Tensor] = []
    for t, g in zip(outputs, grads):
        if t.grad_fn in on_path:
            outs.append(t)
            gouts.append(g)
    try:
        result: Sequence[Tensor | None] = (
            engine.grad(outs, targets, gouts, retain_graph=retain)
            if outs and targets
            else [None] * len(targets)
        )
    except BaseException:
        _remove(handles)
        raise
    # A pass that kept the graph may run the junctions again (W's generic work): the hooks go
    # now. One that freed it can never run them again: they go with the nodes.
    if retain:
        _remove(handles)
    # Phase 3: the captured junctions' gradients are the pass's last results.
    n = len(inputs)
    for k, got in zip(captured, result[n:]):
        work.grads[k] = (got,)
    return list(result[:n]), work


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def backward_whole(
    plan: BackwardWalk,
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor],
    inputs: Sequence[Tensor],
    generic: Sequence[Tensor],
    add: Adder,
    *,
    retain: bool = False,
) -> list[Tensor | None]:
    """An unsplit backward with the plan's direct terms: one engine pass for ``inputs`` and the
    ``generic`` parameters (found by the caller's hooks), each direct term handed to ``add`` as
    soon as its gradient arrives (in cache, and its saved input freed as autograd would).
    ``retain`` keeps the graph (as ``retain_graph``)."""
    work = plan.work
    captured = set(plan.captured)
    terms: dict[int, list[Direct]] = {}
    for term in work.direct:
        terms.setdefault(term.junction, []).append(term)
    work.direct = []
    handles = [
        _compute(work.junctions[k][0], mine, add) for k, mine in terms.items() if k not in captured
    ]
    edges = [GradientEdge(work.junctions[k][0], 0) for k in plan.captured]
    try:
        result = engine.grad(
            list(outputs), _targets(inputs, edges, generic), list(grads), retain_graph=retain
        )
    finally:
        for h in handles:
            h.remove()
    with GradMode(False):  # (inside the engine, hooks run without recording)
        for k, g in zip(plan.captured, result[len(inputs) : len(inputs) + len(edges)]):
            for term in terms.get(k, []):
                add(term, g)
    return list(result[: len(inputs)])


def _targets(*groups: Sequence[Tensor | GradientEdge]) -> list[Any]:
    """What ``autograd.grad`` is asked for: tensors and captured gradient edges, in order."""
    return [t for group in groups for t in group]


def _compute(node: Node, terms: list[Direct], add: Adder) -> Any:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        for term in terms:
            add(term, grad_outputs[0])
            term.saved = None  # freed with the node, as autograd frees it

    return node.register_prehook(hook)
