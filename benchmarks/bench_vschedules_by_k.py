"""How far below 1F1B's activation memory V-Half and V-Min go as the devices K grow.

The V schedules' savings are asymptotic: each device holds two half stages, and the number of
half-stage micro-batches in flight on the fullest device grows more slowly with K than 1F1B's
K full-stage micro-batches. At small K the constant term dominates. This benchmark shows both
halves of that:

- **Held**, from the schedules alone (no model): the most stage micro-batches a device holds at
  once, in full-stage units (a V schedule's half stage counts 1/2), for K = 2 .. 32, and the
  ratio to 1F1B's K.
- **Measured**, on the GPT of models/ made deep enough for 2K stages: each device's activation
  peak over one training step (:func:`benchmarks.bench_vschedules.memory_row`, the same
  measurement and prediction as ``bench_vschedules.py``), the fullest device's against 1F1B's.
  Memory only: no rates (``bench_vschedules.py`` times the schedules).

    python benchmarks/bench_vschedules_by_k.py --write               # K = 2, 4, 8 measured
    python benchmarks/bench_vschedules_by_k.py --workers 2,4,8,16    # a deeper GPT for K = 16
    python benchmarks/bench_vschedules_by_k.py --quick               # seconds; CI smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn import functional as F

import pipepar
from benchmarks import _common as common
from benchmarks._results import markdown_table, record
from benchmarks.bench_vschedules import OPTIMIZER, memory_row, stages
from pipepar.core.named_schedules import make
from pipepar.core.units import format_bytes

TITLE = "V-Half and V-Min by K: the share of 1F1B's activation memory (GPT, one process)"
SCHEDULES = ("1f1b", "v-half", "v-min")
HELD_K = (2, 4, 8, 16, 32)


def held(name: str, k: int) -> float:
    """The most micro-batches the fullest device holds at once, in full-stage units, at
    ``M = max(8, 2K)``."""
    n = stages(name, k)
    order = make(name, n, max(8, 2 * k), n_workers=k)
    return max(order.worker_in_flight(w) for w in range(k)) * k / n


def held_table(ks: tuple[int, ...]) -> str:
    """Held per schedule and K, and as a share of 1F1B's."""
    lines = []
    for k in ks:
        ref = held("1f1b", k)
        lines.append([k, *(f"{held(n, k):g} ({held(n, k) / ref:.2f}x)" for n in SCHEDULES)])
    return markdown_table(["K", *(f"{n}: held (x 1F1B)" for n in SCHEDULES)], lines)


def deep_gpt(k: int, quick: bool) -> common.Workload:
    """A GPT with enough blocks for 2K stages (embedding and head are stages' units too)."""
    depth, width, heads, vocab, seq, m = (2 * k, 32, 2, 64, 16, 2 * k) if quick else (
        max(8, 2 * k), 128, 4, 256, 32, max(8, 2 * k))  # fmt: skip
    import models

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = models.gpt(depth, width, heads, vocab, seq)
    x = torch.randint(vocab, (4 * m, seq), generator=gen)
    y = torch.randint(vocab, (4 * m, seq), generator=gen)
    text = f"GPT {depth} blocks x {width} wide, vocab {vocab}, {4 * m} x {seq} tokens"
    return common.Workload("gpt", model, x, y, F.cross_entropy, text)


def measured_rows(k: int, quick: bool) -> list[dict[str, Any]]:
    """Each schedule's fullest device at K devices: measured and predicted activation peak."""
    work = deep_gpt(k, quick)
    m = max(8, 2 * k) if not quick else 2 * k
    prof = pipepar.profile(work.model, work.x, device="meta", optimizer=OPTIMIZER)
    rows = [memory_row(work, prof, k, m, name) for name in SCHEDULES]
    for row in rows:
        top = max(range(k), key=lambda w: row["measured"][w])
        row |= {"peak": row["measured"][top], "peak_predicted": row["predicted"][top],
                "of_1f1b_memory": row["measured"][top] / max(rows[0]["measured"]),
                "job": work.description}  # fmt: skip
    return rows


def measured_table(rows: list[dict[str, Any]]) -> str:
    """One line per (K, schedule)."""
    lines = [
        [r["k"], r["m"], r["schedule"], r["job"], str(r["balance"]),
         f"{r['held'] * r['k'] / len(r['balance']):g}",
         f"{format_bytes(r['peak'])} ({format_bytes(r['peak_predicted'])}, "
         f"{r['peak_predicted'] / r['peak'] - 1:+.1%})", f"{r['of_1f1b_memory']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    headers = ["K", "M", "schedule", "job", "balance", "held (full-stage units)",
               "activation peak, fullest device (predicted, error)", "x 1F1B memory"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Print both tables; write them to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    before = common.load()
    counts = held_table(HELD_K[:2] if args.quick else HELD_K)
    rows = [row for k in args.workers for row in measured_rows(k, args.quick)]
    note = (
        "Held: from the schedules alone (`pipepar.core.named_schedules.make`, M = max(8, 2K)), "
        "the most stage micro-batches the fullest device holds at once, a V schedule's half "
        "stage counting 1/2. Measured: pipepar.planner.measure.measure_device over one "
        "training step after a warm-up step, less parameters, gradients and Adam state, the "
        "fullest device; predicted: the planner's MemoryModel for it (as bench_vschedules.py); "
        "balance by forward FLOPs, checkpoint='never', cross-entropy. Machine load before "
        f"{before}; after {common.load()}."
    )
    text = f"{counts}\n\n{measured_table(rows)}"
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "vschedules_by_k"))
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=1)
    parser.add_argument(
        "--workers", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4, 8],
        help="devices K measured, comma-separated (default 2,4,8)",
    )  # fmt: skip
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers = [2]
    return args


if __name__ == "__main__":
    raise SystemExit(main())
