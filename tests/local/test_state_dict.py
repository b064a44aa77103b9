"""Checkpoints move between the plain model and pipes of any balance, and resume exactly."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

import pipepar


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def _roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_same_keys_and_values_as_plain() -> None:
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = pipepar.wrap(model, [2, 2, 2], devices=["cpu"] * 3)
    got = pipe.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])


def _in_two_micro_batches(model: nn.Module, balance: list[int]) -> pipepar.Pipe:
    """A pipe of two micro-batches, its batch norm per micro-batch (asked for)."""
    devices = ["cpu"] * len(balance)
    return pipepar.wrap(model, balance, devices=devices, chunks=2, batch_coupling="per-micro-batch")


def test_three_stages_to_plain_to_two_stages_and_back() -> None:
    three = _in_two_micro_batches(_model(), [2, 2, 2])
    three(torch.randn(8, 6)).sum().backward()  # changes batch-norm buffers
    saved = _roundtrip(three.state_dict())
    plain = _model()
    plain.load_state_dict(saved)
    two = pipepar.wrap(_model(), [1, 5], devices=["cpu"] * 2)
    two.load_state_dict(plain.state_dict())
    back = pipepar.wrap(_model(), [3, 3], devices=["cpu"] * 2)
    back.load_state_dict(two.state_dict())
    x = torch.randn(5, 6)
    for m in (three, plain, two, back):
        m.eval()
    for m in (plain, two, back):
        torch.testing.assert_close(m(x), three(x))


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_resume_with_optimizer_state_is_identical() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(6)]
    start = _model()
    # uninterrupted run: 6 steps on a [2, 4] pipe
    full = _in_two_micro_batches(copy.deepcopy(start), [2, 4])
    full_opt = torch.optim.Adam(full.parameters(), lr=1e-2)
    _train(full, full_opt, batches)
    # interrupted: 3 steps, checkpoint, resume on a pipe with another balance
    first = _in_two_micro_batches(copy.deepcopy(start), [2, 4])
    first_opt = torch.optim.Adam(first.parameters(), lr=1e-2)
    _train(first, first_opt, batches[:3])
    ckpt = _roundtrip({"model": first.state_dict(), "optim": first_opt.state_dict()})
    second = _in_two_micro_batches(_model(), [4, 2])
    second.load_state_dict(ckpt["model"])  # type: ignore[index]
    second_opt = torch.optim.Adam(second.parameters(), lr=1e-2)
    second_opt.load_state_dict(ckpt["optim"])  # type: ignore[index]
    _train(second, second_opt, batches[3:])
    for a, b in zip(second.parameters(), full.parameters()):
        assert torch.equal(a, b)
