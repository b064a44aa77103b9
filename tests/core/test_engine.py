"""core.engine: a stage's pass through autograd's engine, the same gradients as autograd.grad."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from pipepar.core import engine


def _graph() -> tuple[Tensor, Tensor, list[Tensor], nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    x = torch.randn(3, 6, requires_grad=True)
    return x, net(x), list(net.parameters()), net


def test_plain_pass_matches_autograd_grad_exactly() -> None:
    x, y, params, _ = _graph()
    g = torch.randn_like(y)
    want = torch.autograd.grad([y], [x, *params], [g], retain_graph=True, allow_unused=True)
    got = engine.grad([y], [x, *params], [g], retain_graph=True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None and b is not None and torch.equal(a, b)


def test_unused_inputs_get_none_and_gradient_edges_are_inputs() -> None:
    x, y, _, _ = _graph()
    unused = torch.zeros(2, requires_grad=True)
    relu = y.grad_fn.next_functions[1][0]  # type: ignore[union-attr]
    edge = GradientEdge(relu, 0)  # where the gradient enters the ReLU
    g = torch.randn_like(y)
    want = torch.autograd.grad([y], [unused, edge, x], [g], retain_graph=True, allow_unused=True)
    got = engine.grad([y], [unused, edge, x], [g])
    assert got[0] is None and want[0] is None
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # type: ignore[arg-type]


def test_plain_pass_does_not_go_through_autograd_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, params, _ = _graph()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.autograd.grad was called")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    got = engine.grad([y], [x, *params], [torch.ones_like(y)])
    assert all(g is not None for g in got)


def test_a_shape_that_differs_raises_autograd_grads_error() -> None:
    x, y, _, _ = _graph()
    wrong = torch.ones(1, 4)  # the engine alone would sum it to the output's shape silently
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        engine.grad([y], [x], [wrong])


def test_a_torch_function_mode_sees_the_call() -> None:
    seen: list[Any] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, y, _, _ = _graph()
    with Watch():
        engine.grad([y], [x], [torch.ones_like(y)])
    assert torch.autograd.grad in seen
