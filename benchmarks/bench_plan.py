"""Planner benchmark: planning time and memory on meta, and predicted vs measured stage peaks.

1. Planning (issue 3): the 10.7B-parameter stack, 40 x Linear(16384, 16384), Adam, 8 devices x
   80 GiB, profiled and planned on the meta device; wall time and peak RSS of a fresh process
   (so nothing else in it counts). The full run also plans a 39.5B GPT (48 x 8192) for 16 GPUs.
2. Accuracy: small models split over CPU "devices"; each stage's predicted peak against the peak
   of a real training step of that stage (forward of M micro-batches, backward, optimizer step),
   measured from the CPU allocator's events (pipepar.measure). Profiles ran on the CPU.

    python benchmarks/bench_plan.py            # full run, writes benchmarks/RESULTS.md
    python benchmarks/bench_plan.py --quick    # CI smoke: fewer cases, no RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
import pipepar  # noqa: E402
from benchmarks._results import markdown_table, record  # noqa: E402
from pipepar.core.units import format_bytes  # noqa: E402
from pipepar.planner.measure import measure_split  # noqa: E402

_PLAN_JOB = textwrap.dedent("""
    import json, resource, sys, time, torch
    from torch import nn
    import models, pipepar
    what = sys.argv[1]
    start = time.perf_counter()
    if what == "stack":
        model = nn.Sequential(*[nn.Linear(16384, 16384, device="meta") for _ in range(40)])
        sample = torch.empty(8, 16384, device="meta")
        kw = dict(devices=8, capacity="80GiB", chunks=8)
    else:
        model = models.gpt(depth=48, width=8192, heads=64, seq_len=2048, device="meta")
        sample = torch.zeros(64, 2048, dtype=torch.long, device="meta")
        kw = dict(devices=16, capacity="80GiB", chunks=32, schedule="1f1b", checkpoint="always")
    plan = pipepar.plan(model, sample, optimizer="adam", **kw)
    print(json.dumps({"seconds": time.perf_counter() - start,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "params": sum(p.numel() for p in model.parameters()),
                      "balance": plan.balance, "peak": plan.peak_bytes,
                      "stages": len(plan.stages)}))
""")


def planning_rows(quick: bool) -> list[list[object]]:
    """Time and peak RSS of planning big models on meta, each in a fresh process."""
    rows = []
    for what in ["stack"] if quick else ["stack", "gpt"]:
        out = subprocess.run(
            [sys.executable, "-c", _PLAN_JOB, what],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        name = (
            "40 x Linear(16384, 16384), 8 x 80 GiB"
            if what == "stack"
            else "GPT 48 x 8192, 16 x 80 GiB, 1f1b"
        )
        rows.append(
            [
                name,
                f"{r['params'] / 1e9:.1f}B",
                f"{r['seconds']:.2f}",
                format_bytes(r["rss"]),
                format_bytes(r["peak"]),
                str(r["balance"]),
            ]
        )
    return rows


# name: (model, input shape, stages, chunks, checkpoint, schedule, optimizer)
CASES = {
    "MLP 8x1024 (params), adam, never": (
        lambda: models.mlp(8, 1024),
        (64, 1024),
        2,
        8,
        "never",
        "gpipe",
        "adam",
    ),
    "MLP 8x1024 (params), sgd, except_last": (
        lambda: models.mlp(8, 1024),
        (64, 1024),
        4,
        8,
        "except_last",
        "gpipe",
        "sgd",
    ),
    "MLP 4x256 GELU (activations), never": (
        lambda: models.mlp(4, 256, activation=nn.GELU),
        (4096, 256),
        2,
        4,
        "never",
        "gpipe",
        "adam",
    ),
    "MLP 4x256 GELU, always": (
        lambda: models.mlp(4, 256, activation=nn.GELU),
        (4096, 256),
        2,
        4,
        "always",
        "gpipe",
        "adam",
    ),
    "MLP 4x256 GELU, 1f1b, except_last": (
        lambda: models.mlp(4, 256, activation=nn.GELU),
        (4096, 256),
        3,
        8,
        "except_last",
        "1f1b",
        "adamw",
    ),
    "ConvNet 64x3x32x32, never": (
        lambda: models.convnet(32),
        (64, 3, 32, 32),
        2,
        4,
        "never",
        "gpipe",
        "sgd-momentum",
    ),
    "ConvNet 64x3x32x32, 1f1b": (
        lambda: models.convnet(32),
        (64, 3, 32, 32),
        3,
        8,
        "never",
        "1f1b",
        "adam",
    ),
    "AlexNet 32x3x224x224, except_last": (
        lambda: pipepar.sequentialize(__import__("torchvision").models.alexnet(weights=None)),
        (32, 3, 224, 224),
        3,
        4,
        "except_last",
        "gpipe",
        "adam",
    ),
}
QUICK = ["MLP 8x1024 (params), adam, never", "MLP 4x256 GELU, 1f1b, except_last"]


def accuracy_rows(quick: bool) -> tuple[list[list[object]], float]:
    """Predicted vs measured peak for every stage of every case; also the worst |error|."""
    rows, worst = [], 0.0
    for name in QUICK if quick else CASES:
        build, shape, k, m, ckpt, schedule, opt = CASES[name]
        torch.manual_seed(0)
        model, x = build(), torch.randn(*shape)
        prof = pipepar.profile(model, x, device="cpu", optimizer=opt)
        plan = pipepar.plan(
            prof, devices=["cpu"] * k, chunks=m, checkpoint=ckpt, schedule=schedule, optimizer=opt
        )
        peaks = measure_split(
            model, x, plan.balance, chunks=m, optimizer=opt, checkpoint=ckpt, schedule=schedule
        )
        for s, measured in zip(plan.stages, peaks):
            error = (s.peak_bytes - measured) / measured
            worst = max(worst, abs(error))
            rows.append(
                [
                    name,
                    f"{s.index} ({s.layers.start}..{s.layers.stop - 1})",
                    format_bytes(s.peak_bytes),
                    format_bytes(measured),
                    f"{error:+.1%}",
                    s.phase,
                ]
            )
    return rows, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer cases, no RESULTS.md (CI smoke)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plan_table = markdown_table(
        ["model", "params", "plan s", "peak RSS", "largest stage", "balance"],
        planning_rows(args.quick),
    )
    rows, worst = accuracy_rows(args.quick)
    acc_table = markdown_table(
        ["case", "stage", "predicted", "measured", "error", "peak during"], rows
    )
    print(plan_table, "\n\n", acc_table, f"\n\nworst |error| {worst:.1%}", sep="")
    if not args.quick:
        record(
            "Planning on the meta device",
            plan_table,
            notes="Profile + plan in a fresh process; peak RSS is the process's ru_maxrss "
            "(torch import included). Target: < 30 s and < 2 GiB for the 10.7B stack.",
        )
        record(
            "Predicted vs measured stage peaks (CPU)",
            acc_table,
            notes=f"Worst |error| over all stages: {worst:.1%} (target: within 10%). Profiles on "
            "the CPU; measured = parameters + optimizer state (+ the batch on stage 0) + "
            "the largest rise of the CPU allocator's total during one training step of "
            "the stage after a warm-up step, read from torch.profiler memory events.",
        )
    return 0 if worst < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
