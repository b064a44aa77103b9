"""The engine on CUDA devices (skipped on machines without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _devices(n: int) -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" for i in range(n)]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_cuda_matches_plain(checkpoint: str) -> None:
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 32), nn.Tanh()
    )
    plain = copy.deepcopy(model).cuda()
    pipe = pipepar.wrap(model, [2, 3], devices=_devices(2), chunks=4, checkpoint=checkpoint)
    x = torch.randn(16, 32, device="cuda:0")
    out = pipe(x)
    assert out.device == pipe.devices[-1]
    torch.testing.assert_close(out.to("cuda:0"), plain(x))
    out.sum().backward()
    plain(x).sum().backward()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad.to("cuda:0"), b.grad, atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.gpu
def test_cuda_autocast_and_cpu_input() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pipe = pipepar.wrap(model, [1, 2], devices=_devices(2), chunks=2)
    with torch.autocast("cuda", dtype=torch.float16):
        out = pipe(torch.randn(8, 16))  # a CPU batch is moved to the first stage's device
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())
