"""Hooks on the parameters (``p.register_hook``) through a pipe (pipepar.core.parameter_hooks):
each runs once per backward, on the whole gradient, as on the plain model, so a hook that is
not linear (clamping each parameter's gradient) gives the plain model's ``.grad``."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from models import transformers_zoo as zoo
from tests._hooks import clamping_hooks

CPU2 = ["cpu", "cpu"]
LIMIT = 0.02  # below most gradients' largest entries: the clamp changes them


def _compare(plain: nn.Module, pipe: nn.Module, run: Callable[[nn.Module], None]) -> None:
    (theirs, theirs_after), (ours, ours_after) = (clamping_hooks(m, LIMIT) for m in (plain, pipe))
    for _ in range(2):  # accumulated over two backwards
        run(plain)
        run(pipe)
    assert ours == theirs and ours_after == theirs_after
    assert set(theirs.values()) == set(theirs_after.values()) == {2}
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("how", ["call", "step"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_parameter_hooks_of_a_model_run_once_on_the_whole_gradient(how: str, schedule: str) -> None:
    torch.manual_seed(0)
    model = zoo.gpt2(layers=4, hidden=32, heads=2, vocab=64, positions=12)  # tied head
    plain = copy.deepcopy(model)
    split = ["transformer.h.2"] if schedule == "1f1b" else [f"transformer.h.{k}" for k in (1, 2, 3)]
    pipe = pipepar.wrap(model, split=split, devices=CPU2, chunks=4, schedule=schedule)
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))

    def run(m: nn.Module) -> None:
        if m is pipe and how == "step":
            pipe.step(input_ids=ids, labels=ids)
        else:
            m(input_ids=ids, labels=ids).loss.backward()

    _compare(plain, pipe, run)
    pipe.close()


@pytest.mark.parametrize("how", ["call", "step"])
def test_parameter_hooks_of_a_sequential_run_once_on_the_whole_gradient(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, balance=[2, 3], devices=CPU2, chunks=4, schedule="1f1b")
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    def run(m: nn.Module) -> None:
        if m is pipe and how == "step":
            pipe.step(x, y, F.mse_loss)
        else:
            F.mse_loss(m(x), y).backward()

    _compare(plain, pipe, run)
    pipe.close()


def test_hooks_registered_and_removed_keep_their_handles_and_order() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = pipepar.wrap(model, balance=[1, 1], devices=CPU2, chunks=2, schedule="1f1b")
    weight = model[1].weight
    order: list[str] = []
    first = weight.register_hook(lambda g: order.append("first"))
    weight.register_hook(lambda g: order.append("second"))
    x = torch.randn(4, 4)
    pipe.step(x, torch.zeros(4, 4), F.mse_loss)
    assert order == ["first", "second"]
    first.remove()  # the handle still finds its hook
    pipe(x).sum().backward()
    assert order == ["first", "second", "second"]
    pipe.close()
