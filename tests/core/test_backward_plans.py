"""core.backward_plans: a plan made once per shape of graph, replayed with the plain numbers.

A stage's micro-batches share one plan when their graphs have one shape; a graph of another
shape (a branch taken on some micro-batches only, a hook added) gets a plan of its own. Every
case runs a split StageStep (B, then W) and compares the input gradients with plain autograd's
bit for bit, and the gradient sums with the plain model's ``.grad``: W's products add into
the sum in one kernel (``addmm_``), whose rounding some BLAS kernels make differ from a
product then an add in the last bits, so the sums are compared within float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipepar.core.backward_plans import BackwardPlans, graph_shape
from pipepar.core.split_backward import by_id
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep

M = 4


class Branch(nn.Module):
    """A Linear, then a second one only for micro-batches whose first value is positive:
    the graphs of one stage take two shapes, and the second Linear's parameters appear in
    one of them only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first, self.extra = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.first(x))
        return torch.tanh(self.extra(y)) if x[0, 0] > 0 else y * 2


def _plain(
    layers: list[nn.Module], xs: list[Tensor], gs: list[Tensor]
) -> tuple[list[Tensor | None], list[Tensor]]:
    """The plain model's ``.grad`` after the micro-batches' backwards, and each input's."""
    model = nn.Sequential(*layers)
    inputs = []
    for x, g in zip(xs, gs):
        leaf = x.detach().requires_grad_()
        model(leaf).backward(g)
        inputs.append(leaf.grad)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, inputs  # type: ignore[return-value]


def _split(
    layers: list[nn.Module], xs: list[Tensor], gs: list[Tensor], stage: Stage | None = None
) -> tuple[StageStep, list[Tensor | None]]:
    """A split StageStep over the micro-batches (every B, then every W) of ``stage`` (one of
    ``layers`` by default); its input grads."""
    stage = stage or Stage(1, 0, layers, torch.device("cpu"))
    step = StageStep(stage, len(xs), checkpoint="never", grad=True, input_grad=True)
    step.split = lambda i: True
    for i, x in enumerate(xs):
        step.forward(i, x)
    inputs = [step.backward(i, (gs[i],))[0] for i in range(len(xs))]
    for i in range(len(xs)):
        step.weight(i)
    return step, inputs


def _check(layers: list[nn.Module], xs: list[Tensor], stage: Stage | None = None) -> StageStep:
    """Run ``layers`` split (as ``stage`` if given) and plain on ``xs``; assert the same input
    gradients and the same sums (within float32 rounding); return the step."""
    with torch.no_grad():
        gs = [torch.randn_like(nn.Sequential(*layers)(x)) for x in xs]
    want, want_inputs = _plain(layers, xs, gs)
    step, inputs = _split(layers, xs, gs, stage)
    got = step.param_grads()
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(inputs, want_inputs):
        assert a is not None and torch.equal(a, b)
    return step


def _made(step: StageStep) -> int:
    plans = step._plans
    assert plans is not None
    return plans.made


def test_micro_batches_of_one_shape_share_one_plan() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()]
    step = _check(layers, [torch.randn(3, 8) for _ in range(M)])
    assert _made(step) == 1


def test_a_stage_keeps_its_plans_from_one_mini_batch_to_the_next() -> None:
    """A step replays the plans its stage made in the last one; a parameter replaced starts
    new plans (the kept ones name the old one), and a copied stage plans over its own."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()]
    stage = Stage(1, 0, layers, torch.device("cpu"))
    xs = [torch.randn(3, 8) for _ in range(M)]
    first = _check(layers, xs, stage)
    second = _check(layers, xs, stage)
    assert second._plans is first._plans and _made(second) == 1
    last = layers[2]
    assert isinstance(last, nn.Linear)
    last.weight = nn.Parameter(last.weight.detach().clone())
    third = _check(layers, xs, stage)
    assert third._plans is not first._plans and _made(third) == 1
    twin = copy.deepcopy(stage)
    copied = _check(twin.layers, xs, twin)
    assert copied._plans is not third._plans and _made(copied) == 1


def test_a_branch_taken_on_some_micro_batches_gets_its_own_plan() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [Branch(8)]
    xs = [torch.randn(3, 8) for _ in range(M)]
    for i, x in enumerate(xs):  # branches: taken, not, taken, not
        x[0, 0] = 1.0 if i % 2 == 0 else -1.0
    step = _check(layers, xs)
    assert _made(step) == 2


def test_a_hook_added_between_micro_batches_changes_the_shape() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    params = by_id(list(lin.parameters()))
    x = torch.randn(3, 8, requires_grad=True)
    before, _ = graph_shape([lin(x)], [x], params)
    handle = lin.weight.register_hook(lambda g: g * 2)
    after, _ = graph_shape([lin(x)], [x], params)
    handle.remove()
    assert before != after
    assert graph_shape([lin(x)], [x], params)[0] == before


@pytest.mark.parametrize("first", ["linear", "mm"])
def test_graphs_that_differ_in_one_node_have_different_shapes(first: str) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    params = by_id(list(lin.parameters()))
    x = torch.randn(3, 8, requires_grad=True)
    linear = lin(x)
    mm = x @ lin.weight.t() + lin.bias  # the same numbers through other nodes
    shapes = {"linear": graph_shape([linear], [x], params)[0]}
    shapes["mm"] = graph_shape([mm], [x], params)[0]
    other = "mm" if first == "linear" else "linear"
    assert shapes[first] != shapes[other]


def test_a_plan_keeps_no_node_or_tensor_of_its_graph() -> None:
    lin = nn.Linear(8, 8)
    plans = BackwardPlans(by_id(list(lin.parameters())))
    x = torch.randn(3, 8, requires_grad=True)
    y = lin(x)
    plans.plan([y], [torch.ones_like(y)], [x])
    (kept,) = plans._plans.values()
    params = {id(p) for p in lin.parameters()}
    for name in ("junctions", "roots", "on_path", "captured"):
        for item in getattr(kept, name):
            assert isinstance(item, (int, tuple))
    assert all(id(t.param) in params for t in kept.terms)
