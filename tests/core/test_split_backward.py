"""Direct weight gradients (core.split_backward): every route equals plain autograd.

A stage's backward runs split (B, then W) or whole; matrix-product junctions (nn.Linear's
addmm / mm) have their weight and bias gradients computed from the saved input instead of a
second autograd pass. Each case runs a StageStep over several micro-batches, split and whole,
as a first stage (input needs no gradient) and as a later one, and compares every parameter
gradient sum and input gradient with autograd on the same micro-batches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

from pipepar.core import step as step_module
from pipepar.core.split_backward import Direct, backward_input, plan_backward
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep

M = 3


@pytest.fixture(autouse=True)
def _direct_for_small_weights(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small test layers take the whole-backward direct route too (it is size-gated)."""
    monkeypatch.setattr(step_module, "LARGE_MATRIX", 1)
    yield


class Twice(nn.Module):
    """One Linear applied twice: its weight is reached from two junctions."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.relu(self.lin(x)))


class RightWeight(nn.Module):
    """``x @ w`` with ``w`` a (in, out) parameter: mm's weight edge is the parameter itself."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


class AlsoScaled(nn.Module):
    """A Linear whose weight is also used elementwise: the weight must take the generic
    route (a direct term and an autograd pass would count one edge twice)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.lin.weight.sum()


class Transposed(nn.Module):
    """A Linear on a non-contiguous 3-D input: matmul's mm, a view and an add for the bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


class RMSNorm(nn.Module):
    """An RMSNorm as transformers writes it: ``weight * normalized``, an elementwise product
    (``right`` puts the weight on the right of it)."""

    def __init__(self, width: int, *, right: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(width) / 10)
        self.right = right

    def forward(self, x: Tensor) -> Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * self.weight if self.right else self.weight * h


def _mlp(width: int, *, bias: bool = True) -> list[nn.Module]:
    return [nn.Linear(width, width, bias=bias), nn.ReLU(), nn.Linear(width, width, bias=bias)]


def _mixed(width: int) -> list[nn.Module]:
    return [
        nn.Linear(width, width),
        nn.LayerNorm(width),
        nn.GELU(),
        RightWeight(width),
        AlsoScaled(width),
        nn.Linear(width, width, bias=False),
        nn.Tanh(),
    ]


CASES: dict[str, tuple[Callable[[int], list[nn.Module]], tuple[int, ...]]] = {
    "linear": (_mlp, (4, 8)),
    "linear-no-bias": (lambda w: _mlp(w, bias=False), (4, 8)),
    "linear-3d": (_mlp, (2, 5, 8)),
    "linear-3d-transposed": (lambda w: [Transposed(w), nn.ReLU(), Transposed(w)], (5, 2, 8)),
    "weight-used-twice": (lambda w: [Twice(w), nn.ReLU(), nn.Linear(w, w)], (4, 8)),
    "right-weight": (lambda w: [RightWeight(w), nn.ReLU(), RightWeight(w)], (4, 8)),
    "mixed": (_mixed, (4, 8)),
    "norms-stacked": (  # generic junctions one below the other: W restarts at each apart
        lambda w: [nn.LayerNorm(w), nn.Linear(w, w), nn.GELU(), nn.LayerNorm(w), nn.Tanh()],
        (4, 8),
    ),
    "rms-norms": (  # elementwise scales: the weight on either side, broadcast over rows
        lambda w: [RMSNorm(w), nn.Linear(w, w), nn.SiLU(), RMSNorm(w, right=True), nn.Tanh()],
        (2, 3, 8),
    ),
    "conv-then-linear": (
        lambda w: [nn.Conv1d(2, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * w, w)],
        (4, 2, 8),
    ),
}


def _reference(
    layers: list[nn.Module], xs: list[Tensor], gs: list[Tensor], input_grad: bool
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Per-parameter gradient sums and per-micro-batch input gradients from plain autograd."""
    model = nn.Sequential(*layers)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: list[Tensor | None] = [None] * len(params)
    inputs: list[Tensor | None] = []
    for x, g in zip(xs, gs):
        leaf = x.detach().requires_grad_(input_grad)
        got = torch.autograd.grad(
            model(leaf), [leaf, *params] if input_grad else params, g, allow_unused=True
        )
        inputs.append(got[0] if input_grad else None)
        for k, part in enumerate(got[1:] if input_grad else got):
            if part is not None:
                sums[k] = part if sums[k] is None else sums[k] + part
    return sums, inputs


def _run(
    layers: list[nn.Module], xs: list[Tensor], gs: list[Tensor], *, split: bool, input_grad: bool
) -> tuple[list[Tensor | None], list[Tensor | None], dict[int, Tensor]]:
    """A StageStep's gradient sums, input gradients and what on_final handed over."""
    handed: dict[int, Tensor] = {}

    def on_final(k: int, g: Tensor) -> None:
        assert k not in handed, "a parameter's sum is handed over once"
        handed[k] = g

    stage = Stage(1 if input_grad else 0, 0, layers, torch.device("cpu"))
    step = StageStep(
        stage,
        len(xs),
        checkpoint="never",
        grad=True,
        input_grad=input_grad,
        split=lambda i: split,
        on_final=on_final,
    )
    for i, x in enumerate(xs):
        step.forward(i, x)
    inputs = []
    for i in reversed(range(len(xs))):
        inputs.append(step.backward(i, (gs[i],))[0])
        step.weight(i)
    return step.param_grads(), inputs[::-1], handed


def _close(got: Tensor | None, want: Tensor | None) -> None:
    assert (got is None) == (want is None)
    if got is not None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not got.requires_grad, "a direct term recorded a graph"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["later-stage", "first-stage"])
def test_gradients_equal_plain_autograd(case: str, split: bool, input_grad: bool) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    layers = build(shape[-1])
    xs = [torch.randn(shape) for _ in range(M)]
    with torch.no_grad():
        gs = [torch.randn_like(nn.Sequential(*layers)(x)) for x in xs]
    want_sums, want_inputs = _reference(layers, xs, gs, input_grad)
    sums, inputs, handed = _run(layers, xs, gs, split=split, input_grad=input_grad)
    assert all(g is None for g in sums), "the last pass hands every sum over"
    for k, want in enumerate(want_sums):
        _close(handed.get(k), want)
    for got, want in zip(inputs, want_inputs):
        _close(got, want)


def test_linear_junctions_become_direct_terms() -> None:
    layers = nn.Sequential(*_mlp(8))
    x = torch.randn(4, 8, requires_grad=True)
    y = layers(x)
    plan = plan_backward([y], [torch.ones_like(y)], [x], list(layers.parameters()))
    assert {id(p) for p in plan.direct_params()} == {id(p) for p in layers.parameters()}
    assert not plan.work.generic() and not plan.conflict


def test_autocast_copies_of_weights_become_direct_terms_with_the_plain_bits() -> None:
    """Under autocast a Linear computes with a bfloat16 copy of its float32 weight and bias;
    W makes their gradients from the saved input in bfloat16 and casts them, as autograd does
    through the copy: nothing generic is left for W (B keeps no graph), and the bits are
    autograd's."""
    torch.manual_seed(0)
    layers = nn.Sequential(*_mlp(8))
    params = list(layers.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layers(x)
    assert y.dtype == torch.bfloat16
    g = torch.randn_like(y)
    plan = plan_backward([y], [g], [x], params)
    assert {id(p) for p in plan.direct_params()} == {id(p) for p in params}
    assert all(t.cast for t in plan.work.direct) and not plan.work.generic()
    _split_has_the_plain_bits(y, g, x, params)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a whole backward too
        y = layers(x)
    whole = plan_backward([y], [g], [x], params, reach=True)
    assert {id(p) for p in whole.direct_params()} == {id(p) for p in params}


def _split_has_the_plain_bits(y: Tensor, g: Tensor, x: Tensor, params: list[Tensor]) -> None:
    """B and W of ``y`` (a split that keeps no graph for W) give autograd's bits exactly."""
    want = torch.autograd.grad([y], [x, *params], [g], retain_graph=True)
    dx, work = backward_input([y], [g], [x], params)
    assert work is not None and work.keep is None  # the graph is not kept for W
    got: dict[int, Tensor] = {}

    def add(term: Direct, grad: Tensor | None) -> None:
        assert grad is not None
        got[id(term.param)] = term.add(grad, None, False)

    work.run_direct(add)
    assert torch.equal(dx[0], want[0])  # type: ignore[arg-type]
    assert all(torch.equal(got[id(p)], w) for p, w in zip(params, want[1:]))


def test_layer_norm_weights_become_direct_terms_with_the_plain_bits() -> None:
    """A split's W computes a LayerNorm's weight and bias with the norm's own backward kernel
    from what the node saved, not with an autograd pass: nothing generic is left, so B does
    not keep the graph, and the gradients are autograd's bit for bit. A whole backward (the
    norm runs there anyway) and a hooked weight keep the generic route."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    params = list(layers.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    y = layers(x)
    g = torch.randn_like(y)
    plan = plan_backward([y], [g], [x], params)
    norms = [t for t in plan.work.direct if t.kernel is not None]
    assert len(norms) == 4 and {id(p) for p in plan.direct_params()} == {id(p) for p in params}
    assert not plan.work.generic()
    _split_has_the_plain_bits(y, g, x, params)
    whole = plan_backward([y], [g], [x], params, reach=True)
    assert not any(t.kernel is not None for t in whole.work.direct)
    layers[0].weight.register_hook(lambda grad: grad)
    hooked = plan_backward([layers(x)], [g], [x], params)
    assert id(layers[0].weight) not in {id(p) for p in hooked.direct_params()}


def test_elementwise_scales_become_direct_terms_with_the_plain_bits() -> None:
    """An RMSNorm's weight (on either side of its product) is a direct term of a split:
    ``grad * normalized`` summed to the weight's shape, autograd's bits; a Llama-style block
    then leaves B nothing to keep. A weight scaling another weight is no such term."""
    torch.manual_seed(0)
    layers = nn.Sequential(RMSNorm(8), nn.Linear(8, 8), RMSNorm(8, right=True))
    params = list(layers.parameters())
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = layers(x)
    g = torch.randn_like(y)
    plan = plan_backward([y], [g], [x], params)
    assert {id(t.param) for t in plan.work.direct if t.kernel is not None} == {
        id(layers[0].weight),
        id(layers[2].weight),
    }
    _split_has_the_plain_bits(y, g, x, params)
    w, v = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8))
    z = x * (w * v)  # the product's both edges are parameters: nothing direct
    assert not plan_backward([z], [torch.ones_like(z)], [x], [w, v]).work.direct


def test_hooked_or_shared_weights_keep_the_generic_route() -> None:
    lin, scaled = nn.Linear(8, 8), AlsoScaled(8)
    lin.weight.register_hook(lambda g: g * 2)
    x = torch.randn(4, 8, requires_grad=True)
    y = scaled(lin(x))
    params = [*lin.parameters(), *scaled.parameters()]
    plan = plan_backward([y], [torch.ones_like(y)], [x], params)
    direct = {id(p) for p in plan.direct_params()}
    assert direct == {id(lin.bias), id(scaled.lin.bias)}


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_a_parameter_hook_still_applies(split: bool) -> None:
    torch.manual_seed(0)
    layers = _mlp(8)
    layers[0].weight.register_hook(lambda g: g * 2)  # type: ignore[union-attr]
    xs = [torch.randn(4, 8) for _ in range(M)]
    gs = [torch.randn(4, 8) for _ in range(M)]
    want_sums, _ = _reference(layers, xs, gs, True)
    _, _, handed = _run(layers, xs, gs, split=split, input_grad=True)
    for k, want in enumerate(want_sums):
        _close(handed.get(k), want)


def test_w_frees_the_micro_batch_graph() -> None:
    layers = [nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)]
    step = StageStep(
        Stage(1, 0, layers, torch.device("cpu")),
        1,
        checkpoint="never",
        grad=True,
        input_grad=True,
        split=lambda i: True,
    )
    y = step.forward(0, torch.randn(4, 8))
    leaf = weakref.ref(step._records[0].input)  # type: ignore[arg-type]
    step.backward(0, (torch.ones_like(y),))
    step.weight(0)
    assert leaf() is None, "something still holds micro-batch 0's graph after W"


def test_a_split_that_needs_no_generic_pass_does_not_keep_the_graph() -> None:
    layers = nn.Sequential(*_mlp(8))
    x = torch.randn(4, 8, requires_grad=True)
    y = layers(x)
    _, work = backward_input([y], [torch.ones_like(y)], [x], list(layers.parameters()))
    assert work is not None and work.keep is None and len(work.direct) == 4


def test_the_walk_orders_every_node_once_after_the_nodes_below_it() -> None:
    """The plan's walk (shared by every backward) lists each reachable node once, after all
    the nodes it leads to, names each by its own name (a node type shared by several kinds
    of node is asked each time) and finds every matrix product."""
    from pipepar.core.split_backward import _Graph

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = lin(torch.tanh(lin(x)))
    y = h.clone()
    y[0] += 1  # CopySlices: a node named in a namespace
    out = [y.sum() + (x @ lin.weight).sum(), h.mean()]
    graph = _Graph(out, [x], list(lin.parameters()))
    position = {node: k for k, node in enumerate(graph.order)}
    assert len(position) == len(graph.order) == len(graph.nexts)
    for node, k in position.items():
        assert node.name() == graph.names[node]
        assert all(position[c] < k for c in graph.nexts[node] if c is not None)
    products = {n for n in graph.order if n.name() in ("AddmmBackward0", "MmBackward0")}
    assert {n for n, _ in graph.products} == products and len(products) == 3
    assert set(graph.params.values()) == set(lin.parameters())


def test_a_walk_given_the_next_nodes_already_read_plans_the_same() -> None:
    """``plan_backward(known=...)``: the next nodes an earlier walk read (part of the graph,
    as a forward's walk knows all but what was made after it) give the very plan of reading
    the graph again, split and whole; the walk takes them as given."""
    from pipepar.core.split_backward import _Graph, by_id

    torch.manual_seed(0)
    layers = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    params = list(layers.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    y = layers(x)
    g = torch.randn_like(y)
    read = _Graph([y], [x], params)
    known = {n: read.nexts[n] for n in read.order[: len(read.order) - 2]}  # the top unknown
    for reach in (False, True):
        want = plan_backward([y], [g], [x], params, reach=reach)
        got = plan_backward([y], [g], [x], by_id(params), reach=reach, known=known)
        assert [n for n, _ in got.work.junctions] == [n for n, _ in want.work.junctions]
        assert [(t.param, t.junction, t.edge) for t in got.work.direct] == [
            (t.param, t.junction, t.edge) for t in want.work.direct
        ]
        assert (got.captured, got.conflict) == (want.captured, want.conflict)
    top = y.grad_fn
    assert _Graph([y], [x], params, {top: []}).order == [top]  # given, not read again
