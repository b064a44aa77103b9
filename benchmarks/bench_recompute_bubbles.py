"""Recompute in place (inside B) against recompute in the bubbles (R actions), at equal memory,
on the GPT of models/ in one process.

Both run ``checkpoint="always"``: every micro-batch keeps only its stage input after F and runs
its stage again before its backward. ``recompute="in_place"`` does that at the start of B, once
the gradient has arrived; ``recompute="bubbles"`` lists it as an R action
(:mod:`pipepar.core.recompute_placement`): just before B, where it runs while B still waits,
or in an earlier idle slot of the worker on the simulated clock, never holding more rebuilt
micro-batches at once than in place. The table shows what a worker holds rebuilt at most (the
schedule's count, :meth:`~pipepar.core.schedule.Schedule.worker_rebuilt`: the same for both),
how many R moved earlier than just before their B, the simulated step of each on unit costs
(F = R = W = 1, B = 1 or 2 whole; in place, B pays its recompute), and the measured rate.

Rate: ``pipepar.wrap(model, balance, devices=["cpu"] * K, chunks=M, schedule=...,
checkpoint="always", recompute=...)`` and ``pipe.step``, the contenders alternating in blocks
of steps (the order rotating each round); each step's samples/s, the median and the p10-p90
spread, and the ratio of bubbles to in place with a bootstrap interval (2000 redraws).

    python benchmarks/bench_recompute_bubbles.py --write      # K = 2 and 4, writes RESULTS.md
    python benchmarks/bench_recompute_bubbles.py --workers 2 --rounds 4 --steps 8
    python benchmarks/bench_recompute_bubbles.py --quick      # seconds; CI smoke test
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
from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.recompute_placement import checkpointed, place_recomputes
from pipepar.core.schedule import Action, Schedule, timed, unit_costs

TITLE = "Recompute in place vs in the bubbles (GPT, one process, checkpoint='always')"
SCHEDULES = ("1f1b", "zb-h1", "zb-v")
PLACES = ("in_place", "bubbles")


def _moved(s: Schedule) -> int:
    """R actions not listed just before their own B."""
    return sum(
        1
        for work in s.actions
        for a, b in zip(work, (*work[1:], None))
        if a.kind == "R" and b != Action(a.stage, "B", a.microbatch)
    )


def _stages(name: str, k: int) -> int:
    return 2 * k if name in VIRTUAL else k


def simulated(name: str, k: int, m: int) -> dict[str, Any]:
    """The schedule's rebuilt count, R moved, and simulated step in place and in the bubbles
    (unit costs)."""
    base = make(name, _stages(name, k), m, n_workers=k)
    cost = unit_costs(base.virtual)

    def in_b(a: Action, split: bool) -> float:  # B runs the forward again first
        return cost(a, split) + (cost(Action(a.stage, "F", 0), False) if a.kind == "B" else 0.0)

    rebuilt = checkpointed(base, "always")
    placed = place_recomputes(base, rebuilt)
    return {
        "held": max(placed.worker_rebuilt(w) for w in range(k)),
        "moved": _moved(placed),
        "sim_in_place": max(timed(base, in_b).values()),
        "sim_bubbles": max(timed(placed, cost).values()),
    }


def _step(work: common.Workload, k: int, m: int, name: str, place: str) -> tuple[Any, Any]:
    model = copy.deepcopy(work.model)
    balance = common.balance(work, _stages(name, k))
    pipe = pipepar.wrap(model, balance, devices=["cpu"] * k, chunks=m, schedule=name,
                        checkpoint="always", recompute=place)  # fmt: skip
    return common.training_step(pipe, work), pipe


def rates(
    work: common.Workload, k: int, m: int, args: argparse.Namespace
) -> tuple[dict[tuple[str, str], list[float]], dict[str, int]]:
    """Samples/s of every timed step of each contender, blocks alternating over rounds; and
    per schedule, the R the pipe placed earlier than just before their B (on its measured
    stage times)."""
    block = math.ceil(args.steps / args.rounds)
    steps, pipes = {}, {}
    for name in args.schedules:
        for place in PLACES:
            step, pipe = _step(work, k, m, name, place)
            step()  # warm-up (and worker start)
            steps[f"{name}|{place}"] = common.local_block(step, block, 1)
            pipes[name, place] = pipe
    runs = common.alternate(steps, args.rounds)
    moved = {name: _moved(pipes[name, "bubbles"].schedule) for name in args.schedules}
    for pipe in pipes.values():
        pipe.close()
    per_step = {
        tuple(key.split("|")): [work.batch / t for r in got for t in r]
        for key, got in runs.items()
    }
    return per_step, moved  # type: ignore[return-value]


def measure(work: common.Workload, k: int, m: int, args: argparse.Namespace) -> list[dict]:
    """One row per (schedule, placement): rate, and bubbles against in place."""
    per_step, moved = rates(work, k, m, args)
    rows = []
    for name in args.schedules:
        sim = simulated(name, k, m) | {"moved_measured": moved[name]}
        ref = per_step[name, "in_place"]
        for place in PLACES:
            got = per_step[name, place]
            q = common.Quantiles.of(got)
            rows.append({
                "k": k, "m": m, "schedule": name, "recompute": place,
                "balance": common.balance(work, _stages(name, k)), **sim,
                "median": q.median, "spread": q.spread(),
                "of_in_place": q.median / statistics.median(ref),
                "interval": common.ratio_interval(got, ref, stat=statistics.median),
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (K, schedule, placement)."""
    lines = []
    for r in rows:
        lo, hi = r["interval"]
        sim = r["sim_in_place"] if r["recompute"] == "in_place" else r["sim_bubbles"]
        moved = f"{r['moved']} ({r['moved_measured']})" if r["recompute"] == "bubbles" else "-"
        lines.append([
            r["k"], r["m"], r["schedule"], r["recompute"], str(r["balance"]), r["held"], moved,
            f"{sim:g} ({sim / r['sim_in_place']:.2f}x)", f"{r['median']:.1f}",
            f"{r['spread']:.0%}", f"{r['of_in_place']:.2f}x ({lo:.2f}-{hi:.2f})",
        ])  # fmt: skip
    headers = ["K", "M", "schedule", "recompute", "balance", "rebuilt held (per worker, max)",
               "R moved earlier, unit costs (measured times)",
               "simulated step, unit costs (x in place)",
               "samples/s median", "spread p10-p90", "x in-place rate (90% interval)"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    before = common.load()
    work = common.workload("gpt", quick=args.quick)
    rows = [r for k in args.workers for r in measure(work, k, args.chunks, args)]
    text = table(rows)
    note = (
        f"Job: {work.description}, cross-entropy, no optimizer, checkpoint='always', "
        f"M={args.chunks}; balance by forward FLOPs. {args.rounds} rounds x "
        f"{math.ceil(args.steps / args.rounds)} timed steps per contender after one untimed "
        "step per block, order rotating. The pipe places its R on unit costs in its first "
        "step, on the stages' measured times from the second on (the count in brackets). "
        "Rebuilt held: the most micro-batches a worker holds "
        "with their graph rebuilt at once (R run, last backward action not yet), the same "
        "bound in place (counted as an R just before each B) and in the bubbles (the "
        "placement's default bound): equal memory. The 2-core machine is shared with other "
        f"jobs: machine load before {before}; after {common.load()}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "recompute_bubbles"))
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=6)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per contender")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument(
        "--workers", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4],
        help="devices K, comma-separated (default 2,4)",
    )  # fmt: skip
    parser.add_argument(
        "--schedules", type=lambda t: tuple(t.split(",")), default=SCHEDULES,
        help="schedules, comma-separated (default 1f1b,zb-h1,zb-v)",
    )  # fmt: skip
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.workers, args.chunks = 1, 2, [2], 4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
