"""Host time a step spends learning how its micro-batch losses join (pipepar.core.losses).

A pipe's step learns its ``loss_fn``'s shares at micro-batch 0 (the probe, on a step's first
kind; then the form kept) and recomputes every micro-batch's count from its own target. This
times that work alone, on the CPU, against one plain call of the loss: the host time per step
a GPU pipeline would see on top of its kernels.

    python benchmarks/bench_loss_learning.py [--write] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import RESULTS, markdown_table, record
from pipepar.core.losses import loss_shares, split_target

TITLE = "Loss shares: host time per step"


def _shares_once(loss_fn: Callable, out: torch.Tensor, y: torch.Tensor, m: int) -> None:
    rows = [len(y) // m] * m
    targets = split_target(y, rows)
    shares = loss_shares(loss_fn, targets, rows)
    shares.head_of(loss_fn, targets)(out[: rows[0]], 0)
    list(shares)


def _us(fn: Callable[[], None], steps: int) -> list[float]:
    for _ in range(max(steps // 10, 1)):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for CI")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    steps = 20 if args.quick else args.steps
    out, y = torch.randn(64, 100), torch.randint(0, 100, (64,))
    y[::5] = -1
    rows = []
    for m in (1, 4, 8, 16):
        loss_fn = functools.partial(F.cross_entropy, ignore_index=-1)
        learned = _us(lambda: _shares_once(loss_fn, out, y, m), steps)  # noqa: B023
        plain = _us(lambda: F.cross_entropy(out[: 64 // m], y[: 64 // m], ignore_index=-1), steps)  # noqa: B023
        rows.append(
            {
                "micro_batches": m,
                "shares_us_median": statistics.median(learned),
                "shares_us_p90": statistics.quantiles(learned, n=10)[-1],
                "plain_loss_us_median": statistics.median(plain),
            }
        )
    table = markdown_table(
        ["micro-batches", "shares per step, median (us)", "p90 (us)", "one plain CE (us)"],
        [
            [r["micro_batches"], f"{r['shares_us_median']:.0f}", f"{r['shares_us_p90']:.0f}",
             f"{r['plain_loss_us_median']:.0f}"]
            for r in rows
        ],
    )  # fmt: skip
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(rows))
    if args.write or args.quick:
        notes = (
            f"{steps} steps each; 64 rows of a 100-class cross-entropy with ignore_index=-1 "
            "(every fifth target ignored). The form is learned on the first step and kept; each "
            "step then recomputes its micro-batches' real-target counts."
        )
        record(TITLE, table, notes=notes, path=args.results)


if __name__ == "__main__":
    main()
