"""A stage output without the batch on dimension 0 is a ValueError naming the layer at fault.

The pipe splits the batch on dimension 0 and joins the last stage's outputs there; a layer
that reduces the batch away (a 0-dim loss, a sum) or changes its rows at the end of a stage
used to end in ``torch.cat``'s cryptic error, or in a wrongly joined output; one that repeats
or drops rows is this check's to name too, not the probe's. Every stage output
is checked once per micro-batch, on the threaded executor and on the one-stage direct path.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import pipepar

W = 5
MODES = ["always", "except_last", "never"]


class Reduce(nn.Module):
    """Sums the batch away (``()``) or, with ``repeat``, doubles its rows; does neither when
    ``on`` is False, so one pipe can be called again with a sound model."""

    def __init__(self, *, repeat: bool = False) -> None:
        super().__init__()
        self.repeat, self.on = repeat, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return x
        return x.repeat(2, 1) if self.repeat else x.sum()


class Pass(nn.Module):
    """Returns its input (a 0-dim tensor too), so a dropped batch reaches the stage's end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _model(reduce: Reduce, at: int) -> nn.Sequential:
    """``fc1, act, fc2, out`` with ``reduce`` inserted as layer ``at``, named ``bad``."""
    layers = [("fc1", nn.Linear(W, W)), ("act", Pass()), ("fc2", nn.Linear(W, W)), ("out", Pass())]
    layers.insert(at, ("bad", reduce))
    return nn.Sequential(OrderedDict(layers))


class Doubled(Reduce):
    def __init__(self) -> None:
        super().__init__(repeat=True)


class Dropped(Reduce):
    """Drops the first row of its micro-batch (``x[1:]``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[1:] if self.on else x


# (case, layer, position, balance, the stage's last layer: index, name, class, output shape)
CASES = [
    ("mid-pipe 0-dim", Reduce, 1, [2, 3], (1, "bad", "Reduce", "()")),
    ("0-dim passed on to the stage's end", Reduce, 1, [3, 2], (2, "act", "Pass", "()")),
    ("last layer 0-dim", Reduce, 4, [3, 2], (4, "bad", "Reduce", "()")),
    ("mid-pipe rows doubled", Doubled, 3, [4, 1], (3, "bad", "Doubled", "(6, 5)")),
    ("last layer rows doubled", Doubled, 4, [2, 3], (4, "bad", "Doubled", "(6, 5)")),
    ("mid-pipe rows dropped", Dropped, 3, [4, 1], (3, "bad", "Dropped", "(2, 5)")),
]


def _pipe(
    case: tuple, *, balance: list[int] | None = None, checkpoint: str = "except_last"
) -> tuple[nn.Module, Reduce, nn.Sequential]:
    """The pipe of ``case`` (3 micro-batches of 3 rows for a batch of 9), its layer at fault,
    and the model."""
    _, make, at, default_balance, _ = case
    reduce = make()
    model = _model(reduce, at)
    balance = balance or default_balance
    pipe = pipepar.wrap(
        model, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint
    )
    return pipe, reduce, model


def _assert_names_the_layer(error: ValueError, expected: tuple) -> None:
    index, name, kind, shape = expected
    message = str(error)
    assert f"layer {index} '{name}' ({kind})" in message
    assert f"returned shape {shape} for a micro-batch of 3 rows" in message
    assert "Keep the batch on dimension 0" in message and "pipe.step" in message


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_stage_output_without_the_batch_names_its_last_layer(
    case: tuple, grad: bool, checkpoint: str
) -> None:
    pipe, reduce, model = _pipe(case, checkpoint=checkpoint)
    plain = copy.deepcopy(model)
    x = torch.randn(9, W)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError) as info:
        pipe(x)
    _assert_names_the_layer(info.value, case[4])
    assert any("micro-batch 0, forward" in note for note in info.value.__notes__)
    # The pipe runs again once the layer keeps the batch.
    reduce.on = False
    for layer in plain:
        if isinstance(layer, Reduce):
            layer.on = False
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(pipe(x), plain(x))
    pipe.close()


# Where nothing after the layer needs the batch (a Linear would fail on a 0-dim input first).
TO_THE_END = [c for c in CASES if c[2] >= 3]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("case", TO_THE_END, ids=[c[0] for c in TO_THE_END])
def test_one_stage_names_its_last_layer_too(case: tuple, checkpoint: str) -> None:
    # "never" (and any mode without grad) runs the direct path: plain autograd, no executor.
    pipe, reduce, model = _pipe(case, balance=[5], checkpoint=checkpoint)
    name, last = list(model.named_children())[-1]
    shape = case[4][3]
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError) as info:
            pipe(torch.randn(9, W))
        where = f"layer 4 '{name}' ({type(last).__name__}), the last of stage 0 (layers 0..4"
        assert where in str(info.value)
        assert f"returned shape {shape} for a micro-batch of 3 rows" in str(info.value)
    reduce.on = False
    x = torch.randn(9, W, requires_grad=True)
    pipe(x).sum().backward()
    assert x.grad is not None


def test_a_tuple_with_a_scalar_shows_every_shape() -> None:
    class WithTotal(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.sum()

    pipe = pipepar.wrap(nn.Sequential(nn.Linear(W, W), WithTotal()), [1, 1], devices=2, chunks=2)
    with pytest.raises(
        ValueError, match=r"layer 1 \(WithTotal\).*returned shape \[\(2, 5\), \(\)\]"
    ):
        pipe(torch.randn(4, W))


def test_a_loss_inside_the_model_still_runs_under_step() -> None:
    # pipe.step's loss takes the last stage's output as it is: nothing joins it.
    model = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 1), Reduce())
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=2, chunks=3)
    x = torch.randn(9, W)
    # A value the model reduced before the loss saw it: its divisor is not seen, so say it.
    with pytest.raises(pipepar.LossNotJoinable, match="items="):
        pipe.step(x, None, lambda output, _: output)
    # Each micro-batch's loss is its sum, weighted by the count items= gives (1/3 each).
    loss = pipe.step(x, None, lambda output, _: output, items=lambda _: 1)
    expected = plain(x) / 3
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_batch_of_zero_rows_passes() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Linear(W, W), nn.ReLU()), [1, 1], devices=2, chunks=4)
    assert pipe(torch.randn(0, W)).shape == (0, W)
