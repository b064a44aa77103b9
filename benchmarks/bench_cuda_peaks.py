"""The planner's CUDA memory against the GPU, for every balance of one model.

The model of the CUDA memory tests (``models.gpt(4, 128, 4, 512, 64)``, 16 x 64 tokens, Adam,
M=4, two workers on ``cuda:0``, float32 with TF32 off) is profiled twice, on the GPU and on the
CPU; for every two-stage balance and each schedule, each worker's predicted device peak
(:class:`~pipepar.planner.stage_memory.MemoryModel`) is set against the peak that worker's
actions allocate when run on the GPU (:func:`~pipepar.planner.measure.measure_device`).

A fixed balance, not one the plan picks: a plan from a GPU profile balances by measured times,
so its balance changes from run to run, and with it what a test of the plan measures.

    python benchmarks/bench_cuda_peaks.py                       # 1f1b and zb-h1
    python benchmarks/bench_cuda_peaks.py --schedules gpipe

Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
from pipepar.core.named_schedules import make
from pipepar.planner.measure import measure_device
from pipepar.planner.profile import Profile, profile
from pipepar.planner.stage_memory import MemoryModel

M = 4


def _profiles(model: torch.nn.Sequential, ids: torch.Tensor) -> dict[str, Profile]:
    found = {}
    for where in ("cuda", "cpu"):
        found[where] = profile(model.to(where), ids.to(where), device=where, optimizer="adam")
    model.to("cuda")
    return found


def rows(schedules: list[str]) -> list[str]:
    """One line per schedule, balance and worker: measured bytes, and each profile's
    prediction with its error."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = models.gpt(4, 128, 4, 512, 64, device="cuda")
    ids = torch.randint(512, (16, 64), generator=torch.Generator().manual_seed(1)).cuda()
    profiles = _profiles(model, ids)
    n = len(model)
    lines = []
    for schedule in schedules:
        order = make(schedule, 2, M, n_workers=2)
        for k in range(1, n):
            ranges = [(0, k - 1), (k, n - 1)]
            for w in range(2):
                got = measure_device(
                    model, ids, [k, n - k], device=w, chunks=M, optimizer="adam",
                    checkpoint="never", schedule=order,
                )  # fmt: skip
                cells = []
                for where, prof in profiles.items():
                    mm = MemoryModel(prof, order, checkpoint="never", foreach=[True, True])
                    want = sum(p.peak_bytes for p in mm.device(w, [ranges[w]]))
                    cells.append(f"{where} {want} ({100 * (want - got) / got:+.1f}%)")
                line = f"{schedule:6} [{k}, {n - k}] w{w} measured {got}: " + ", ".join(cells)
                print(line, flush=True)
                lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-h1", help="comma list of two-stage ones")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_peaks.py needs a CUDA device and there is none here", file=sys.stderr)
        return 2
    rows(args.schedules.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
