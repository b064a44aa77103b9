"""Plan a GPT-style model of ~40 billion parameters for a cluster of GPUs, on a laptop.

The model is built and profiled on the ``meta`` device, so nothing is allocated: a model that
needs ~600 GiB for its weights and Adam state is planned in seconds with a few hundred MiB of
RAM. The planner picks the split so every GPU fits, prints the table and writes an HTML report.

    python examples/plan_giant.py                       # 48 x 8192 GPT, 16 x 80 GiB GPUs
    python examples/plan_giant.py --devices 8 --schedule gpipe --html /tmp/giant.html
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import pipepar
from pipepar import zoo
from pipepar.core.units import format_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=48, help="transformer blocks")
    parser.add_argument("--width", type=int, default=8192, help="model width")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64, help="sequences per mini-batch")
    parser.add_argument("--devices", type=int, default=16, help="GPUs in the pipeline")
    parser.add_argument("--capacity", default="80GiB", help="memory per GPU")
    parser.add_argument("--chunks", type=int, default=32, help="micro-batches per mini-batch")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument(
        "--checkpoint", default="always", choices=["always", "except_last", "never"]
    )
    parser.add_argument("--html", default="plan_giant.html", help="where to write the report")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = zoo.gpt(
        depth=args.depth, width=args.width, heads=args.heads, seq_len=args.seq_len, device="meta"
    )
    tokens = torch.zeros(args.batch, args.seq_len, dtype=torch.long, device="meta")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT: {args.depth} blocks x {args.width} wide, {params / 1e9:.1f}B parameters, "
        f"{len(model)} layers; batch {args.batch} x {args.seq_len} tokens"
    )
    try:
        plan = pipepar.plan(
            model,
            tokens,
            devices=[f"cuda:{i}" for i in range(args.devices)],
            capacity=args.capacity,
            optimizer="adam",
            chunks=args.chunks,
            schedule=args.schedule,
            checkpoint=args.checkpoint,
        )
    except ValueError as err:
        print(f"does not fit: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(pipepar.report.table(plan, width=150))
    path = pipepar.report.save_html(plan, args.html)
    print(
        f"planned in {seconds:.1f} s; largest stage {format_bytes(plan.peak_bytes)} of "
        f"{args.capacity}; report: {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
