"""Draw one measured timeline per schedule (the pictures in README's "Schedules" section).

Runs the benchmark model, 8 x (Linear(1024, 1024) + ReLU), on two CPU workers with one math
thread each, 8 micro-batches, through ``pipe.step`` for every schedule, and saves the last
mini-batch of each as ``docs/schedules/<name>.png`` (one lane per worker):

    python examples/schedule_timelines.py [--out docs/schedules] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import pipepar
from pipepar import timeline
from pipepar.core.named_schedules import NAMES, VIRTUAL
from pipepar.zoo import mlp


def draw(name: str, out: Path, steps: int) -> Path:
    """Train ``steps`` mini-batches with schedule ``name``; draw the last one."""
    torch.manual_seed(0)
    model = mlp()
    balance = [4, 4, 4, 4] if name in VIRTUAL else [8, 8]
    pipe = pipepar.wrap(
        model, balance, devices=["cpu", "cpu"], chunks=8, schedule=name, checkpoint="never",
        threads=1, trace=True,
    )  # fmt: skip
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    for _ in range(steps):
        pipe.step(x, y, nn.functional.mse_loss)
        model.zero_grad()
    assert pipe.tracer is not None
    last = pipe.tracer.timeline().steps()[-1].by_worker(pipe.schedule.placement)
    title = f"{name}: K=2 workers, M=8, bubble {last.bubble:.0%} (schedule's own: "
    title += f"{pipe.schedule.bubble():.0%})"
    return timeline.save(last, out / f"{name}.png", width=1100, title=title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/schedules"))
    parser.add_argument("--steps", type=int, default=4, help="mini-batches per schedule (>= 2)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        print(draw(name, args.out, max(2, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
