"""Two losses from one pipe call (an auxiliary loss on the same output): backward once through
their sum equals the plain model; a second backward through the same output, which
``retain_graph=True`` allows on the plain model, stops with an error that says what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import pipepar
from models import transformers_zoo as zoo

CPU2 = ["cpu", "cpu"]


def _pair(kind: str) -> tuple[nn.Module, nn.Module, Tensor]:
    torch.manual_seed(0)
    if kind == "sequential":
        model: nn.Module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
        pipe = pipepar.wrap(copy.deepcopy(model), balance=[2, 1], devices=CPU2, chunks=2)
        return model, pipe, torch.randn(4, 6)
    model = zoo.gpt2(layers=2, hidden=16, heads=2, vocab=32, positions=8)
    pipe = pipepar.wrap(copy.deepcopy(model), split=["transformer.h.1"], devices=CPU2, chunks=2)
    return model, pipe, torch.randint(0, 32, (4, 8))


def _output(m: nn.Module, x: Tensor) -> Tensor:
    out = m(x)
    return out if isinstance(out, Tensor) else out.logits


def _losses(out: Tensor) -> tuple[Tensor, Tensor]:
    return out.square().mean(), out.tanh().sum() / 10  # a main and an auxiliary loss


@pytest.mark.parametrize("kind", ["sequential", "model"])
def test_two_losses_of_one_call_backward_once_or_a_clear_error(kind: str) -> None:
    plain, pipe, x = _pair(kind)
    main, aux = _losses(_output(plain, x))
    (main + aux).backward()
    ours_main, ours_aux = _losses(_output(pipe, x))
    (ours_main + ours_aux).backward()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    ours_main, ours_aux = _losses(_output(pipe, x))
    ours_main.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph") as error:
        ours_aux.backward()
    assert "backward() once" in str(error.value)
    pipe.close()
