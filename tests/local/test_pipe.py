"""The pipe is transparent: same outputs, same gradients, same state as the plain model."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from tests._stacks import WIDTH, grads_of, random_balance, random_stack

MODES = ["always", "except_last", "never"]


def _compare(model: nn.Sequential, balance: list[int], chunks: int, checkpoint: str) -> None:
    # float64, so that 1e-5 measures the engine and not float32 summation order
    model = model.double()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint
    )
    x = torch.randn(13, WIDTH, dtype=torch.float64)
    x_plain, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = plain(x_plain), pipe(x_pipe)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (expected**2).sum().backward()
    (got**2).sum().backward()
    torch.testing.assert_close(x_pipe.grad, x_plain.grad, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(24))
def test_random_stacks_match_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    n_layers = rng.randint(2, 9)
    n_stages = rng.randint(1, min(4, n_layers))
    balance = random_balance(rng, n_layers, n_stages) if n_stages > 1 else [n_layers]
    torch.manual_seed(seed)
    _compare(random_stack(rng, n_layers), balance, rng.randint(1, 16), rng.choice(MODES))


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_every_mode_and_chunk_count(checkpoint: str, chunks: int) -> None:
    _compare(random_stack(random.Random(1), 6), [2, 2, 2], chunks, checkpoint)


def test_gradients_accumulate_over_steps_like_plain() -> None:
    model = random_stack(random.Random(2), 6)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [3, 3], devices=["cpu", "cpu"], chunks=4)
    for _ in range(3):
        x = torch.randn(8, WIDTH)
        pipe(x).sum().backward()
        plain(x).sum().backward()
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_training_with_optimizer_tracks_plain() -> None:
    model = random_stack(random.Random(3), 6)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 4], devices=["cpu", "cpu"], chunks=3)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pipe, plain)]
    for _ in range(5):
        x, y = torch.randn(9, WIDTH), torch.randn(9, WIDTH)
        for m, opt in zip((pipe, plain), opts):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sequential_api() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    layers = list(model)
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    assert pipe.balance == [2, 1]
    assert pipe.devices == [torch.device("cpu")] * 2
    assert (pipe.chunks, pipe.checkpoint) == (2, "never")
    assert len(pipe) == 3
    assert list(pipe) == layers
    assert pipe[2] is layers[2] and pipe[-1] is layers[2]
    assert list(pipe[0:2]) == layers[:2]
    assert [list(p) for p in pipe.partitions] == [layers[:2], layers[2:]]
    assert isinstance(pipe, pipepar.Pipe)


def test_frozen_model_and_no_grad_give_plain_output() -> None:
    model = random_stack(random.Random(4), 4)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(6, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    pipe.eval()
    plain.eval()
    torch.testing.assert_close(pipe(x), plain(x))


def test_batch_smaller_than_chunks() -> None:
    _compare_small = random_stack(random.Random(5), 4)
    plain = copy.deepcopy(_compare_small)
    pipe = pipepar.wrap(_compare_small, [2, 2], devices=["cpu", "cpu"], chunks=8)
    x = torch.randn(3, WIDTH)
    torch.testing.assert_close(pipe(x), plain(x))


def test_tuple_values_between_stages() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.argmax(dim=1)

    class Use(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, idx = pair
            return self.lin(x) + idx.unsqueeze(1).float()

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Split(), Use())
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(7, WIDTH)
    torch.testing.assert_close(pipe(x), plain(x))
    pipe(x).sum().backward()
    plain(x).sum().backward()
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b)


def test_autocast_passes_through_stages() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [1, 2], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = pipe(x), plain(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
    got.float().sum().backward()
    expected.float().sum().backward()
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


class _CastProbe(nn.Linear):
    """A Linear that notes where the bf16 copy of its weight, saved for backward, lives."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.copies: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        saved = y.grad_fn._saved_mat2  # type: ignore[union-attr]
        if saved is not None:  # saved where the layer's input needs a gradient
            assert saved.dtype == torch.bfloat16
            self.copies.append(saved.untyped_storage().data_ptr())
        return y


class _Full(nn.Linear):
    """A Linear that computes in float32 under an autocast (its own region, autocast off)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_autocast_casts_each_weight_once_per_step_as_the_plain_loop(schedule: str) -> None:
    """Under one autocast a plain loop casts each weight once and every micro-batch saves that
    copy; a pipe's stage does the same, instead of keeping a copy per micro-batch in flight.
    Its backward runs outside the autocast, as a plain backward does: a layer that computes in
    float32 gets its float32 backward (under autocast its products would be bfloat16)."""
    torch.manual_seed(0)
    model = nn.Sequential(_CastProbe(8), nn.ReLU(), _CastProbe(8), _Full(8, 8), _CastProbe(8))
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, [2, 3], devices=["cpu", "cpu"], chunks=4, schedule=schedule, checkpoint="never"
    )
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, y, lambda out, t: ((out.float() - t) ** 2).mean())
    losses = []
    for a, b in zip(x.split(4), y.split(4)):  # each micro-batch's gradients summed in float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(((plain(a).float() - b) ** 2).mean() / 4)
        losses[-1].backward()  # outside the autocast, as its documentation advises
    for layer in (2, 4):
        assert len(model[layer].copies) == 4
        assert len(set(model[layer].copies)) == 1, f"layer {layer}: a weight copy per micro-batch"
    torch.testing.assert_close(loss, sum(losses).detach())
    # The pipe's backward runs outside the autocast too: float32 arithmetic, not bfloat16.
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_matches_torchgpipe() -> None:
    torchgpipe = pytest.importorskip("torchgpipe")
    model = random_stack(random.Random(6), 6)
    theirs = torchgpipe.GPipe(copy.deepcopy(model), [3, 3], devices=["cpu", "cpu"], chunks=4)
    ours = pipepar.wrap(model, [3, 3], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(8, WIDTH)
    torch.testing.assert_close(ours(x), theirs(x))


def test_moving_the_pipe_where_it_is_does_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"])
    weight = pipe[0].weight
    assert pipe.to("cpu") is pipe and pipe.to(device=torch.device("cpu")) is pipe
    assert pipe.cpu() is pipe and pipe[0].weight is weight
    assert pipe.to("cpu", torch.float64) is pipe and weight.dtype == torch.float64


def test_moving_the_pipe_elsewhere_is_refused() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"])
    with pytest.raises(ValueError, match=r"pipe.to\(device\) would move the stages on \['cpu'\]"):
        pipe.to("meta")
    with pytest.raises(ValueError, match="places its stages itself"):
        pipe.cuda()
    assert pipe[0].weight.device.type == "cpu"
    assert pipe.to(torch.float64)[0].weight.dtype == torch.float64


def test_empty_batch_and_non_contiguous_input() -> None:
    model = random_stack(random.Random(7), 4)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    empty = pipe(torch.zeros(0, WIDTH))
    assert empty.shape == (0, WIDTH)
    empty.sum().backward()
    x = torch.randn(6, 2 * WIDTH)[:, ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(pipe(x), plain(x))


@pytest.mark.parametrize("checkpoint", MODES)
def test_in_place_first_layer_of_a_stage(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    model.append(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(WIDTH, 2)))
    model = model.double()
    _compare(model, [1, 2, 1], 3, checkpoint)


class _TwinGrads(torch.autograd.Function):
    """``x * (a + b)`` whose backward hands ``a`` and ``b`` views of one gradient tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * (a + b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (x,) = ctx.saved_tensors
        shared = (g * x).sum(0)
        return g * 0 + g, shared, shared.view(shared.shape)  # a's and b's grads alias


class _Twin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TwinGrads.apply(x, self.a, self.b)


@pytest.mark.parametrize("chunks", [2, 4])
def test_gradient_sums_survive_aliased_and_view_gradients(chunks: int) -> None:
    # Linear's weight gradient is a view spanning a fresh product (summed into in place);
    # _Twin's two gradients share one storage (must be copied before any in-place sum).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Twin(), nn.Linear(4, 4), _Twin()).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    plain(x).pow(2).sum().backward()
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint="never")
    pipe(x).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
        assert q.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-12), name
