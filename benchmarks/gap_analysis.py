"""Where a one-process pipeline's step goes, from its timeline: compute, waits, idle.

Traces ``pipe.step`` on the benchmark job (8 x (Linear(1024, 1024) + ReLU), batch 256, M=8,
two CPU workers with one math thread each, checkpoint off) and splits each worker's step time
into forward, backward (B), weight gradients (W), waits for a neighbour, and idle time with no
action (start, end, between actions). The reference is the one-core job: the same micro-batches
one after another on one thread, whose half is what each worker would take with no overhead.

    python benchmarks/gap_analysis.py [--schedule zb-v] [--steps 20] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks._common import accumulation_step, load, step_times, workload
from benchmarks._results import markdown_table, record
from pipepar.core.named_schedules import VIRTUAL

KINDS = ("forward", "backward", "weight", "recompute", "wait", "transfer")


def _one_core(steps: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = step_times(accumulation_step(workload("mlp"), 8, optimizer=False), steps + 1)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[1:])


def _traced(schedule: str, steps: int) -> list[dict[str, float]]:
    work = workload("mlp")
    balance = [4, 4, 4, 4] if schedule in VIRTUAL else [8, 8]
    pipe = pipepar.wrap(
        work.model, balance, devices=["cpu", "cpu"], chunks=8, schedule=schedule,
        checkpoint="never", threads=1, trace=True,
    )  # fmt: skip
    rows = []
    for k in range(steps + 2):
        assert pipe.tracer is not None
        pipe.tracer.clear()
        start = time.perf_counter()
        pipe.step(work.x, work.y, nn.functional.mse_loss)
        end = time.perf_counter()
        work.model.zero_grad(set_to_none=True)
        if k >= 2:  # warm-up
            rows += _split(pipe.tracer.events, pipe.schedule.placement, start, end)
    return rows


def per_worker(events, placement) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    """Per worker, in order: the seconds its traced ``events`` of each kind of :data:`KINDS`
    took (``placement``: the schedule's stage -> worker)."""
    return [
        {kind: sum(e.duration for e in events if e.lane(placement) == w and e.kind == kind)
         for kind in KINDS}
        for w in sorted(set(placement))
    ]  # fmt: skip


def _split(events, placement, start: float, end: float) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    rows = []
    for w, row in enumerate(per_worker(events, placement)):
        busy = sum(row[k] for k in ("forward", "backward", "weight", "wait", "transfer"))
        row.update(worker=w, step=end - start, idle=(end - start) - busy)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zb-v")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    half = _one_core(args.steps) / 2
    rows = _traced(args.schedule, args.steps)
    table_rows = []
    for w in sorted({int(r["worker"]) for r in rows}):
        mine = [r for r in rows if r["worker"] == w]

        def ms(key: str, rows: list[dict[str, float]] = mine) -> str:
            return f"{statistics.median(r[key] for r in rows) * 1e3:.1f}"

        compute = statistics.median(r["forward"] + r["backward"] + r["weight"] for r in mine)
        table_rows.append(
            [w, ms("step"), ms("forward"), ms("backward"), ms("weight"),
             f"{compute * 1e3:.1f}", f"{half * 1e3:.1f}", ms("wait"), ms("idle")]
        )  # fmt: skip
    table = markdown_table(
        ["worker", "step ms", "F", "B", "W", "compute", "half of one core", "wait", "idle"],
        table_rows,
    )
    print(table)
    if args.write:
        record(
            f"Where the step goes: {args.schedule} in one process",
            table,
            notes=f"Medians over {args.steps} traced steps; {load()}.",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
