"""Activation offload against keeping the activations: each schedule's activation peak on its
fullest device and its training rate, with and without ``offload=True``, in the same run.

Memory: every device's peak over one training step (after a warm-up step) by
:func:`pipepar.planner.measure.measure_device` with and without ``offload``: on the CPU the
activations that are away sit in memory Python owns, outside torch's allocator, as host memory
is outside a GPU's, so the allocator's peak drops as a GPU's would. The activation peak is the
device's peak less its parameters, gradients and Adam state; the table gives the device with the
largest peak without offload.

Rate: ``pipepar.wrap(model, balance, devices=["cpu"] * K, chunks=M, schedule=..., offload=...)``
and ``pipe.step``, both alternating in blocks of steps (the order rotating each round); each
step's samples/s, the median and the p10-p90 spread, and the ratio to the same schedule without
offload with a bootstrap interval. On the CPU each copy is a memory copy: what a GPU pays is a
PCIe round trip on a side stream that overlaps compute, which only a GPU measures.

    python benchmarks/bench_offload.py --write         # K = 2 and 4, writes RESULTS.md
    python benchmarks/bench_offload.py --quick         # seconds; CI smoke test
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks._results import markdown_table, record
from pipepar.core.units import format_bytes
from pipepar.planner.measure import measure_device

TITLE = "Activation offload vs keeping the activations: peak and rate (GPT, one process)"
SCHEDULES = ("1f1b", "gpipe")
OPTIMIZER = "adam"


def peaks(work: common.Workload, k: int, m: int, name: str) -> dict[bool, int]:
    """The activation peak of the device fullest without offload, without and with it."""
    bal = common.balance(work, k)
    ranges = common.stage_ranges(bal)
    found: dict[bool, list[int]] = {}
    for offload in (False, True):
        found[offload] = []
        for w in range(k):
            a, b = ranges[w]
            static = _static_bytes(work, a, b)
            got = measure_device(work.model, work.x, bal, device=w, chunks=m,
                                 optimizer=OPTIMIZER, schedule=name, offload=offload)  # fmt: skip
            found[offload].append(got - static)
    top = max(range(k), key=lambda w: found[False][w])
    return {offload: found[offload][top] for offload in (False, True)}


def _static_bytes(work: common.Workload, start: int, stop: int) -> int:
    """Parameters, their gradients and Adam's two moments."""
    return 4 * sum(p.numel() * p.element_size() for p in work.model[start:stop].parameters())


def rates(work: common.Workload, k: int, m: int, args: argparse.Namespace) -> dict[str, list]:
    """Samples/s of every timed step of each (schedule, offload), blocks alternating."""
    block = math.ceil(args.steps / args.rounds)
    steps, pipes = {}, []
    for name in args.schedules:
        for offload in (False, True):
            model = copy.deepcopy(work.model)
            pipe = pipepar.wrap(model, common.balance(work, k), devices=["cpu"] * k, chunks=m,
                                schedule=name, checkpoint="never", offload=offload)  # fmt: skip
            step = common.training_step(pipe, work)
            step()  # warm-up (and worker start)
            steps[_key(name, offload)] = common.local_block(step, block, 1)
            pipes.append(pipe)
    runs = common.alternate(steps, args.rounds)
    for pipe in pipes:
        pipe.close()
    return {key: [work.batch / t for r in got for t in r] for key, got in runs.items()}


def _key(name: str, offload: bool) -> str:
    return f"{name}{' + offload' if offload else ''}"


def measure(work: common.Workload, k: int, m: int, args: argparse.Namespace) -> list[dict]:
    """Two rows per schedule: without and with offload."""
    per_step = rates(work, k, m, args)
    rows = []
    for name in args.schedules:
        peak = peaks(work, k, m, name)
        ref = per_step[_key(name, False)]
        for offload in (False, True):
            got = per_step[_key(name, offload)]
            q = common.Quantiles.of(got)
            rows.append({
                "k": k, "m": m, "schedule": name, "offload": offload,
                "peak": peak[offload], "of_kept_memory": peak[offload] / peak[False],
                "median": q.median, "spread": q.spread(),
                "of_kept_rate": q.median / statistics.median(ref),
                "rate_interval": common.ratio_interval(got, ref, stat=statistics.median),
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (K, schedule, offload)."""
    lines = [
        [r["k"], r["m"], r["schedule"], "yes" if r["offload"] else "no",
         format_bytes(r["peak"]), f"{r['of_kept_memory']:.2f}x", f"{r['median']:.1f}",
         f"{r['spread']:.0%}",
         f"{r['of_kept_rate']:.2f}x ({r['rate_interval'][0]:.2f}-{r['rate_interval'][1]:.2f})"]
        for r in rows
    ]  # fmt: skip
    headers = ["K", "M", "schedule", "offload", "activation peak (fullest device)",
               "x without offload", "samples/s median", "spread p10-p90",
               "rate x without offload (90% interval)"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    before = common.load()
    work = common.workload("gpt", quick=args.quick)
    rows = [r for k in args.workers for r in measure(work, k, args.chunks, args)]
    text = table(rows)
    note = (
        f"Job: {work.description}, cross-entropy, Adam state counted (and left out of the "
        f"peak), checkpoint='never', M={args.chunks}; balance by forward FLOPs. "
        f"{args.rounds} rounds x {math.ceil(args.steps / args.rounds)} timed steps per "
        "contender after one untimed step per block, order rotating. Activation peak: "
        "pipepar.planner.measure.measure_device less parameters, gradients and Adam state, on "
        "the device fullest without offload. CPU stand-in: what is away sits outside torch's "
        "allocator; each copy is a memcpy (a GPU's is a PCIe transfer overlapping compute). "
        f"The 2-core machine is shared: load before {before}; after {common.load()}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "offload"))
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=6)
    common.add_schedule_options(parser)
    args = parser.parse_args(argv)
    args.schedules = SCHEDULES
    if args.quick:
        args.rounds, args.steps, args.workers, args.chunks = 1, 2, [2], 4
        args.schedules = ("gpipe",)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
