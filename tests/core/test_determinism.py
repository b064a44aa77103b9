"""The same seed gives the same parameters: across runs, and across balances where math allows.

What is bit-exact and what is not (measured on CPU, float32):

* Pipe vs pipe, same ``chunks``: bit-identical for ANY balance, stage count and checkpoint mode,
  provided every stage computes with the same number of math threads. Each micro-batch meets
  the same kernels on the same shapes whichever stage holds a layer, recomputation replays the
  forward exactly, and a stage sums its parameter gradients over micro-batches in a fixed order
  (m-1 .. 0). Thread counts matter because CPU reductions (bias gradients, layer norm) split
  their work per thread: a one-stage pipe runs on the caller's threads, a K-stage pipe gives each
  worker ``torch.get_num_threads() // K``. These tests pin one math thread everywhere.
* Pipe vs plain model, ``chunks=1``: bit-identical (same kernels, same shapes, same order).
* Pipe vs plain model, ``chunks=M > 1``: NOT bit-identical, only close (about 1e-7 relative
  after a few Adam steps). A layer's weight gradient is a sum over the batch rows; the plain
  model's matmul sums all rows at once, the pipe sums M partial sums of micro-batches. Float
  addition is not associative, so the last bits differ.
* Random layers (``nn.Dropout``, ``F.dropout``, ``torch.rand_like`` masks, anything that draws
  from torch's generators): with ONE worker (one stage, or all stages on the caller's thread),
  the stages draw from the global generator in micro-batch order, exactly like the plain model
  run on each micro-batch in turn. With SEVERAL workers, they would race for the generator on
  their threads, so each (stage, micro-batch) forward draws from a stream of its own, seeded by
  one number drawn from the global generator per mini-batch that draws anything. Runs with
  the same seed, balance and chunks are then bit-identical; other balances or chunk counts
  draw other masks (a different, equally valid random run), and so does the plain model.
  Recompute replays every draw (``tests/core/test_randomness.py``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import pipepar

BALANCES = [[8], [4, 4], [1, 7], [3, 3, 2], [2, 2, 2, 2]]


@pytest.fixture(autouse=True)
def _one_math_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(*, dropout: float | None = None, batch_norm: bool = False) -> nn.Sequential:
    """8 layers; layers 3 and 6 are Dropout(dropout), or Identity for None."""
    torch.manual_seed(0)
    norm: nn.Module = nn.BatchNorm1d(64) if batch_norm else nn.LayerNorm(64)

    def drop() -> nn.Module:
        return nn.Identity() if dropout is None else nn.Dropout(dropout)

    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), norm, drop(), nn.Linear(64, 64), nn.GELU(), drop(),
        nn.Linear(64, 8),
    )  # fmt: skip


def _train(model: nn.Module, *, steps: int = 4, seed: int = 1) -> torch.Tensor:
    """Adam steps on seeded batches; returns every parameter and buffer, flattened."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x, y = torch.randn(24, 32), torch.randn(24, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([t.detach().flatten().float() for t in model.state_dict().values()])


def _pipe(model: nn.Sequential, balance: list[int], **kwargs: object) -> pipepar.Pipe:
    kwargs.setdefault("batch_coupling", "per-micro-batch")  # batch norm per micro-batch, asked
    return pipepar.wrap(model, balance, devices=["cpu"] * len(balance), threads=1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_balance_gives_bit_identical_parameters(checkpoint: str) -> None:
    results = [
        _train(_pipe(_model(batch_norm=True), b, chunks=4, checkpoint=checkpoint)) for b in BALANCES
    ]
    for balance, got in zip(BALANCES[1:], results[1:]):
        assert torch.equal(got, results[0]), f"balance {balance} differs from {BALANCES[0]}"


def test_same_seed_same_parameters_across_runs() -> None:
    first = _train(_pipe(_model(), [3, 3, 2], chunks=3))
    second = _train(_pipe(_model(), [3, 3, 2], chunks=3))
    other_seed = _train(_pipe(_model(), [3, 3, 2], chunks=3), seed=2)
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)  # the seed does matter


def test_one_chunk_matches_the_plain_model_bit_for_bit() -> None:
    plain = _train(_model(batch_norm=True))
    for balance in BALANCES:
        got = _train(_pipe(_model(batch_norm=True), balance, chunks=1))
        assert torch.equal(got, plain), f"balance {balance}"


def test_micro_batches_match_the_plain_model_within_float_tolerance() -> None:
    plain = _train(_model())
    got = _train(_pipe(_model(), [4, 4], chunks=4))
    # Close, not equal: the pipe sums weight gradients over 4 micro-batches (see module doc).
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)


class _Jitter(nn.Module):
    """Sleeps a random few milliseconds (from its own generator) to shuffle thread timing."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(torch.rand((), generator=self.rng)) * 0.003)
        return x


def _dropout_pipe(jitter_seed: int, checkpoint: str) -> pipepar.Pipe:
    model = _model(dropout=0.3)
    layers = [*model[:4], _Jitter(jitter_seed), *model[4:]]
    return _pipe(nn.Sequential(*layers), [2, 3, 4], chunks=4, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_dropout_in_several_stages_is_reproducible(checkpoint: str) -> None:
    # Two stages draw dropout masks concurrently; different sleeps change who draws first.
    runs = [_train(_dropout_pipe(seed, checkpoint)) for seed in range(3)]
    for run in runs[1:]:
        assert torch.equal(run, runs[0])
    assert not torch.equal(runs[0], _train(_dropout_pipe(0, checkpoint), seed=2))


def test_dropout_masks_are_the_same_with_and_without_recompute() -> None:
    # Checkpointing replays each micro-batch's stream, so it changes memory, not the result.
    assert torch.equal(_train(_dropout_pipe(0, "always")), _train(_dropout_pipe(0, "never")))


def test_dropout_one_stage_pipe_matches_plain_model() -> None:
    # One stage runs on the caller's thread straight from the global generator, like the plain
    # model; several stages draw per-(stage, micro-batch) streams, so they differ from it.
    plain = _train(_model(dropout=0.3))
    assert torch.equal(_train(_pipe(_model(dropout=0.3), [8], chunks=1)), plain)
    assert not torch.equal(_train(_pipe(_model(dropout=0.3), [4, 4], chunks=1)), plain)


def test_global_generator_after_a_step_does_not_depend_on_stages() -> None:
    # The stages' draws come from private streams: what the caller draws next is the same
    # whatever the balance (one seed drawn per mini-batch).
    after = []
    for balance in ([4, 4], [2, 3, 3]):
        pipe = _pipe(_model(dropout=0.3), balance, chunks=4)
        torch.manual_seed(5)
        pipe(torch.randn(8, 32)).sum().backward()
        after.append(torch.rand(4))
    assert torch.equal(after[0], after[1])


def test_inference_is_deterministic_and_matches_plain() -> None:
    model = _model(dropout=0.3, batch_norm=True)
    plain = copy.deepcopy(model).eval()
    pipe = _pipe(model, [3, 5], chunks=4).eval()
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(pipe(x), pipe(x))
        torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-6)


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x * 1.0


def test_recompute_replays_masks_while_a_stage_without_randomness_recomputes() -> None:
    # Regression: a stage without random layers used to save and restore the global generator
    # around its own recompute without the RNG lock, on its worker thread. Restoring in the
    # middle of the random stage's replay changed its recomputed dropout masks: wrong
    # gradients in 10 runs out of 10 with this model, and a clobbered generator after backward.
    for _ in range(3):
        model = nn.Sequential(_Slow(), _Slow(), _Slow(), nn.Dropout(0.5))
        pipe = _pipe(model, [2, 2], chunks=8, checkpoint="always")
        x = (torch.rand(32, 64) + 0.5).requires_grad_()
        out = pipe(x)
        state = torch.get_rng_state()
        out.sum().backward()
        # out = x * mask * 2 elementwise, so d(sum out)/dx = out / x with the forward's masks
        torch.testing.assert_close(x.grad, out.detach() / x.detach())
        assert torch.equal(torch.get_rng_state(), state)  # backward leaves the caller's stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_dropout_in_several_cuda_stages_is_reproducible(checkpoint: str) -> None:
    # Two stages on one GPU share its generator: each (stage, micro-batch) seeds its own stream.
    def run() -> torch.Tensor:
        pipe = pipepar.wrap(
            _model(dropout=0.3), [4, 4], devices=["cuda:0"] * 2, chunks=4, checkpoint=checkpoint
        )
        torch.manual_seed(1)
        torch.cuda.manual_seed(1)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        for _ in range(3):
            x, y = torch.randn(24, 32, device="cuda"), torch.randn(24, 8, device="cuda")
            opt.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in pipe.parameters()]).cpu()

    first = run()
    assert torch.equal(run(), first)
