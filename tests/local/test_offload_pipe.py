"""``offload=True`` in one process: every schedule, a chain and a model cut while it runs, give
bit for bit what the same pipe gives without offload (dropout included), follow the plain
model, and hold less memory while they do (the CPU stand-in keeps what is away outside torch's
allocator, as host memory is outside a GPU's)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL
from pipepar.core.offload import MIN_BYTES
from pipepar.core.offload_plan import Offloader
from pipepar.planner.measure import measure_device
from tests._small_models import Residual

WIDTH, ROWS, M = 512, 256, 8  # a micro-batch's activation: 32 rows x 512 x 4 B = 64 KiB


def _chain(dropout: float, width: int = WIDTH, blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def _chain_pipe(model: nn.Sequential, schedule: str, **kw: object) -> pipepar.Pipe:
    n = 4 if schedule in VIRTUAL else 2
    return pipepar.wrap(
        model, [12 // n] * n, devices=["cpu", "cpu"], chunks=M, schedule=schedule, **kw
    )


def _step(pipe: pipepar.Pipe, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(2)
    loss = pipe.step(x, y, nn.functional.mse_loss)
    return [loss.detach(), *(p.grad for p in pipe.parameters())]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("schedule", NAMES)
def test_a_chain_steps_as_without_offload_and_as_the_plain_model(schedule: str) -> None:
    x, y = _batch()
    kept = _step(_chain_pipe(_chain(0.1), schedule, checkpoint="never"), x, y)
    sent = _step(_chain_pipe(_chain(0.1), schedule, checkpoint="never", offload=True), x, y)
    assert _equal(sent, kept)
    plain = _chain(0.0)
    offloaded = _chain_pipe(copy.deepcopy(plain), schedule, checkpoint="never", offload=True)
    got = _step(offloaded, x, y)
    nn.functional.mse_loss(plain(x), y).backward()
    want = [nn.functional.mse_loss(plain(x), y).detach(), *(p.grad for p in plain.parameters())]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_offload_with_recompute_and_in_evaluation() -> None:
    x, y = _batch()
    for checkpoint in ("except_last", "always"):
        kept = _step(_chain_pipe(_chain(0.1), "1f1b", checkpoint=checkpoint), x, y)
        pipe = _chain_pipe(_chain(0.1), "1f1b", checkpoint=checkpoint, offload=True)
        assert _equal(_step(pipe, x, y), kept)
    with torch.no_grad():  # nothing is saved, nothing sent
        assert torch.equal(pipe.eval()(x), _chain(0.1).eval()(x))


def test_a_model_cut_while_it_runs_steps_as_without_offload(offloaders: list[Offloader]) -> None:
    x, target = _batch()
    results = []
    for offload in (False, True):
        pipe = pipepar.wrap(
            Residual(WIDTH, WIDTH), split=["blocks.2"], devices=["cpu", "cpu"], chunks=M,
            schedule="zb-h1", offload=offload,
        )  # fmt: skip
        torch.manual_seed(2)
        loss = pipe.step(x, target=target, loss_fn=nn.functional.mse_loss)
        results.append([loss.detach(), *(p.grad for p in pipe.parameters())])
    assert _equal(results[1], results[0])
    counts = offloaders[-1].counts()
    assert counts.sent > 0 and counts.late == 0


def test_what_is_sent_comes_back_before_its_backward(offloaders: list[Offloader]) -> None:
    assert ROWS // M * WIDTH * 4 >= MIN_BYTES  # the micro-batches' activations are sent
    x, y = _batch()
    _step(_chain_pipe(_chain(0.1), "1f1b", checkpoint="never", offload=True), x, y)
    (offloader,) = offloaders
    counts = offloader.counts()
    # Stage 0 of 2 sends 6 of its 8 micro-batches, each with 5 tensors that are no one
    # else's (2 blocks: GELU's input, dropout's mask, the next Linear's input; the first
    # Linear's input is the stage's); stage 1 runs each backward right after its forward.
    assert counts.tensors == 6 * 5 and counts.sent == counts.tensors * ROWS // M * WIDTH * 4
    assert counts.reloaded == counts.sent and counts.late == 0
    assert counts.resident == 0


def _first_device_peak(
    model: nn.Sequential, x: torch.Tensor, balance: list[int], schedule: str, offload: bool
) -> int:
    return measure_device(
        model, x, balance, device=0, chunks=M, schedule=schedule, optimizer=None, offload=offload
    )


@pytest.mark.parametrize(
    ("schedule", "balance", "bound"), [("gpipe", [12, 12], 0.5), ("1f1b", [6] * 4, 0.75)]
)
def test_offload_lowers_the_peak_of_the_first_device(
    schedule: str, balance: list[int], bound: float
) -> None:
    """Measured on the CPU allocator (the stand-in keeps what is away outside it); Linear(256)
    layers, whose backward frees what it read as it goes (no plan reads the graph first)."""
    x, model = torch.randn(1024, 256), _chain(0.0, 256, blocks=8)
    peaks = [_first_device_peak(model, x, balance, schedule, o) for o in (False, True)]
    weights = sum(p.numel() * 4 for p in model[: balance[0]].parameters())
    kept, sent = (peak - 2 * weights - x.numel() * 4 for peak in peaks)  # and gradients
    assert sent < bound * kept, (sent, kept)


def test_offload_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="offload must be True or False, but got 1"):
        _chain_pipe(_chain(0.0), "1f1b", offload=1)
