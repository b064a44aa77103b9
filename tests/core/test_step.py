"""core.step: gradient sums of a small stage added after each pass, the plain model's numbers."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipepar.core.stage import Stage
from pipepar.core.step import StageStep

M = 4


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()]


def _plain_sums(layers: list[nn.Module], xs: list[Tensor], gs: list[Tensor]) -> list[Tensor]:
    """What the plain model's ``.grad`` holds after the micro-batches' backwards."""
    model = nn.Sequential(*layers)
    for x, g in zip(xs, gs):
        model(x).backward(g)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_small_stage_sums_equal_the_plain_grads(split: bool) -> None:
    """Whole: the plain bits. Split: W's products add into the sum in one kernel
    (``addmm_``), which some BLAS kernels round differently from a product then an add."""
    layers = _layers()
    xs = [torch.randn(3, 8) for _ in range(M)]
    gs = [torch.randn(3, 8) for _ in range(M)]
    want = _plain_sums(layers, xs, gs)
    stage = Stage(1, 0, layers, torch.device("cpu"))
    step = StageStep(
        stage, M, checkpoint="never", grad=True, input_grad=True, split=lambda i: split
    )
    for i, x in enumerate(xs):
        step.forward(i, x)
    for i in range(M):
        step.backward(i, (gs[i],))
        step.weight(i)
    got = step.param_grads()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None
        if split:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)


def test_small_stage_backward_registers_no_parameter_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _layers()
    params = {id(p) for layer in layers for p in layer.parameters()}
    hooked: list[int] = []
    register = Tensor.register_hook

    def counting(self: Tensor, hook):  # type: ignore[no-untyped-def]
        if id(self) in params:
            hooked.append(id(self))
        return register(self, hook)

    monkeypatch.setattr(Tensor, "register_hook", counting)
    stage = Stage(1, 0, layers, torch.device("cpu"))
    step = StageStep(stage, M, checkpoint="never", grad=True, input_grad=True)
    for i in range(M):
        step.forward(i, torch.randn(3, 8))
    for i in range(M):
        step.backward(i, (torch.randn(3, 8),))
    assert hooked == []  # summed after each pass: no hook per parameter and pass
    assert all(g is not None for g in step.param_grads())
