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
from pipepar.core.offload import MIN_BYTES
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


def test_tensors_too_small_to_send_stay_in_the_prediction() -> None:
    """Saved tensors under offload's MIN_BYTES stay on the device (their copy would cost more
    than it frees): here every one, so offload changes neither peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())])
    x = torch.randn(1024, 32)
    assert MIN_BYTES > 1024 // 8 * 32 * 4  # a micro-batch's tensor
    prof = pipepar.profile(model, x, device="meta", optimizer="adam")
    memory = MemoryModel(
        prof, make("gpipe", 2, 8, n_workers=2), checkpoint="never", foreach=[False] * 2,
        offload=True,
    )  # fmt: skip
    for w, layers in enumerate([(0, 3), (4, 7)]):
        predicted = sum(p.peak_bytes for p in memory.device(w, [layers]))
        got = measure_device(model, x, [4, 4], device=w, chunks=8, schedule="gpipe", offload=True)
        kept = measure_device(model, x, [4, 4], device=w, chunks=8, schedule="gpipe")
        assert got == kept and predicted == pytest.approx(got, rel=0.01), (w, predicted, got)


class _Heads(nn.Module):
    """Attention's pattern without its weights: three views with gaps of one projection's
    output, and a result saved twice, as itself and reshaped (two tensors, one storage)."""

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        out = (q * k).softmax(-1) * v
        return out.sin() + out.reshape(out.shape).cos()


@pytest.mark.parametrize(("schedule", "k"), [("1f1b", 4), ("zb-h1", 4), ("gpipe", 2)])
def test_views_of_one_storage_and_large_matrices_under_offload(schedule: str, k: int) -> None:
    """The store sends what the forward's storages hold, each once (the gapped views of the
    projection as its whole output, the result saved twice once), and what comes back goes
    as the backward is done with it, on a stage whose weight matrices are large enough for
    the direct products too: the prediction, which counts storages, follows."""
    torch.manual_seed(0)
    width = 256  # Linear(256, 768): over LARGE_MATRIX elements
    model = nn.Sequential(
        *[m for _ in range(4) for m in (nn.Linear(width, 3 * width), _Heads(), nn.GELU())]
    )
    x = torch.randn(512, width)
    prof = pipepar.profile(model, x, device="meta", optimizer=None)
    memory = MemoryModel(
        prof, make(schedule, k, 8, n_workers=k), checkpoint="never", foreach=[False] * k,
        offload=True,
    )  # fmt: skip
    balance = [12 // k] * k
    for w in range(k):
        layers = (sum(balance[:w]), sum(balance[: w + 1]) - 1)
        predicted = sum(p.peak_bytes for p in memory.device(w, [layers]))
        got = measure_device(
            model, x, balance, device=w, chunks=8, schedule=schedule, optimizer=None, offload=True
        )
        assert -0.01 <= predicted / got - 1 <= 0.05, (w, predicted, got)
