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


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_offload_on_cuda_steps_as_without_it_and_holds_less(schedule: str) -> None:
    """Pinned host memory and a side stream: the numbers are those without offload, every
    reload came in time, and the first device's peak is lower (K=4 stages on the GPUs there
    are, M=8)."""
    from pipepar.core import offload_plan

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.GELU())])
    x, y = torch.randn(2048, 1024, device="cuda:0"), torch.randn(2048, 1024)
    results, peaks, made = [], [], []
    init = offload_plan.Offloader.__init__

    def record(self: offload_plan.Offloader, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    offload_plan.Offloader.__init__ = record  # type: ignore[method-assign]
    try:
        for offload in (False, True):
            pipe = pipepar.wrap(copy.deepcopy(model), [4] * 4, devices=_devices(4), chunks=8,
                                schedule=schedule, checkpoint="never", offload=offload)  # fmt: skip
            target = y.to(pipe.devices[-1])
            pipe.step(x, target, nn.functional.mse_loss)  # warm-up
            pipe.zero_grad()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loss = pipe.step(x, target, nn.functional.mse_loss)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            results.append([loss.detach(), *(p.grad.clone() for p in pipe.parameters())])
            pipe.close()
    finally:
        offload_plan.Offloader.__init__ = init  # type: ignore[method-assign]
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    counts = made[-1].counts()
    assert counts.sent > 0 and counts.late == 0
    assert peaks[1] < peaks[0], peaks
