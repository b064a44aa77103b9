"""The planner's memory model under activation offload: a micro-batch sent out holds its input
and output until it comes back, and one that came back waits for W whole. Its prediction for
every device against the peak measured with the CPU stand-in (what is away sits outside
torch's allocator)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import make
from pipepar.planner.measure import measure_device
from pipepar.planner.stage_memory import MemoryModel


@pytest.mark.parametrize(
    ("schedule", "k", "over"), [("1f1b", 4, 0.01), ("gpipe", 2, 0.01), ("zb-h1", 4, 0.05)]
)
def test_predicted_peaks_with_offload_follow_the_measured_ones(
    schedule: str, k: int, over: float
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())])
    x = torch.randn(1024, 256)
    prof = pipepar.profile(model, x, device="meta", optimizer="adam")
    balance = [16 // k] * k
    ranges = [(sum(balance[:w]), sum(balance[: w + 1]) - 1) for w in range(k)]
    predicted = {}
    for offload in (False, True):
        memory = MemoryModel(
            prof, make(schedule, k, 8, n_workers=k), checkpoint="never", foreach=[False] * k,
            offload=offload,
        )  # fmt: skip
        predicted[offload] = [
            sum(p.peak_bytes for p in memory.device(w, [ranges[w]])) for w in range(k)
        ]
    for w in range(k):
        got = measure_device(model, x, balance, device=w, chunks=8, schedule=schedule, offload=True)
        assert -0.01 <= predicted[True][w] / got - 1 <= over, (w, predicted[True][w], got)
    assert predicted[True][0] < predicted[False][0]  # the first device holds less
