"""Random layers do not serialize the stages: a GPT with dropout 0.1 vs the same GPT without.

Every stage's random draws go through pipepar's replay (a stream per stage and micro-batch,
holding the generator only for one random operator at a time), so stages with dropout in every
block should overlap as well as stages without. Each contender is a two-stage pipe on two CPU
workers (one math thread each), ``chunks=8``, ``pipe.step`` with the given schedule and
checkpoint mode; the figure is the ratio of the per-step rates with and without dropout.

    python benchmarks/bench_dropout.py [--quick] [--rounds 5] [--steps 4] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import pipepar
from benchmarks._common import Workload, accumulation_step, alternate, load, timer
from benchmarks._results import markdown_table, record

CASES = (("gpipe", "never"), ("1f1b", "except_last"), ("zb-v", "never"))


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _sizes(quick: bool) -> tuple[int, int, int, int, int, int]:
    return (4, 32, 2, 64, 16, 16) if quick else (8, 256, 4, 2048, 64, 32)


def _one_core(dropout: float, quick: bool, steps: int):  # type: ignore[no-untyped-def]
    """The same micro-batches one after another on one thread (the unit of the ideal)."""
    depth, width, heads, vocab, seq, batch = _sizes(quick)
    torch.manual_seed(0)
    model = models.gpt(depth, width, heads, vocab, seq, dropout=dropout)
    x, y = torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))
    step = accumulation_step(Workload("gpt", model, x, y, _loss, ""), 8, optimizer=False)
    step()
    return timer(step, steps)


def _contender(dropout: float, schedule: str, checkpoint: str, quick: bool, steps: int):  # type: ignore[no-untyped-def]
    depth, width, heads, vocab, seq, batch = _sizes(quick)
    torch.manual_seed(0)
    model = models.gpt(depth, width, heads, vocab, seq, dropout=dropout)
    n = len(model)
    balance = (
        [n // 4, n // 4, n // 4, n - 3 * (n // 4)] if schedule == "zb-v" else [n // 2, n - n // 2]
    )
    pipe = pipepar.wrap(
        model, balance, devices=["cpu", "cpu"], chunks=8, schedule=schedule,
        checkpoint=checkpoint, threads=1,
    )  # fmt: skip
    x, y = torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))

    def step() -> None:
        pipe.step(x, y, _loss)
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    return timer(step, steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps timed per round")
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the one-core reference runs here; each pipe worker sets its own
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    rounds = 2 if args.quick else args.rounds
    steps = 1 if args.quick else args.steps
    rows = []
    for schedule, checkpoint in CASES:
        contenders = {
            (kind, p): _one_core(p, args.quick, steps)
            if kind == "one core"
            else _contender(p, schedule, checkpoint, args.quick, steps)
            for kind in ("one core", "pipe")
            for p in (0.0, 0.1)
        }
        times = alternate(contenders, rounds)
        med = {key: statistics.median(v) for key, v in times.items()}
        # Fraction of the ideal: one core's time over two workers, against the pipe's.
        eff = {p: med[("one core", p)] / (2 * med[("pipe", p)]) for p in (0.0, 0.1)}
        rows.append(
            [schedule, checkpoint, f"{med[('pipe', 0.0)] * 1e3:.0f}",
             f"{med[('pipe', 0.1)] * 1e3:.0f}", f"{eff[0.0]:.2f}", f"{eff[0.1]:.2f}",
             f"{eff[0.1] / eff[0.0]:.2f}"]
        )  # fmt: skip
    table = markdown_table(
        ["schedule", "checkpoint", "ms/step p=0", "ms/step p=0.1", "of ideal p=0",
         "of ideal p=0.1", "with / without"],
        rows,
    )  # fmt: skip
    print(table)
    if args.write and not args.quick:
        record(
            "Dropout in every block keeps the stages overlapping",
            table,
            notes=f"GPT 8 blocks x 256, vocab 2048, 32 x 64 tokens, K=2 CPU workers, M=8; "
            f"{rounds} alternating rounds of {args.steps} steps, medians; {load()}.",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
