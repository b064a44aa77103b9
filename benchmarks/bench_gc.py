"""Python's collector across ranks: the default (automatic) against ``gc_every=`` (pipepar's).

A full pass of Python's cycle collector over a process that imported transformers takes about
0.2 s. The one-core job makes almost no tracked garbage and never sets one off; a pipe's step
makes thousands of short-lived tracked objects, and the collector runs a full pass now and
then, on each rank at a step of its own while the other rank waits. With ``gc_every=N`` the
collector is off during each step, the young generations are collected after it and a full
pass runs every N steps, the same step on every rank.

Two ranks bound to a core each run transformers' GPT-2 of ``bench_models`` (8 blocks x 256,
16 x 64 tokens, M=8, zb-v, four stages split at blocks 2, 4 and 6); both pipes live on both
ranks and take turns in blocks of steps, every step started after a barrier (its time is the
slower rank's). The table gives each contender's mean, median, 90th-percentile and longest
step, how many steps took over 1.3 times the median, and each rank's own time in the
collector per step and its passes over 50 ms (full ones).

    python benchmarks/bench_gc.py --write
    python benchmarks/bench_gc.py --quick      # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import atexit
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks import bench_models as bm
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record

TITLE = "Python's collector across ranks: automatic, or gc_every (GPT-2, zb-v, two ranks)"
CONTENDERS = {"automatic (gc_every=None)": None, "gc_every=100": 100}


_IN_COLLECTOR = [0.0, 0.0]  # seconds spent in Python's collector so far; start of the pass


def _clock(phase: str, info: dict[str, Any]) -> None:
    now = time.perf_counter()
    if phase == "start":
        _IN_COLLECTOR[1] = now
    else:
        _IN_COLLECTOR[0] += now - _IN_COLLECTOR[1]


def rank_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], Any]:
    """Factory run on each rank: ``build(contender, m) -> step`` for the two contenders. Each
    step's seconds in Python's collector are written to ``spec["stats"]/rank<r>.json`` when
    the rank ends."""
    from pipepar.local import cpu_malloc

    cpu_malloc.tune()
    collected: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    gc.callbacks.append(_clock)
    path = Path(spec["stats"]) / f"rank{rank}.json"
    atexit.register(lambda: path.write_text(json.dumps(collected)))
    work = bm.job("gpt2", quick=spec["quick"])
    schedule = spec["schedule"]

    def build(contender: str, m: int) -> Callable[[], None]:
        import pipepar.distributed as ppd

        paths = bm.split(work, bm.stages(schedule))
        pipe = ppd.wrap(
            copy.deepcopy(work.model), split=paths, chunks=m, schedule=schedule,
            checkpoint="never", gc_every=CONTENDERS[contender],
        )  # fmt: skip

        def step() -> None:
            before = _IN_COLLECTOR[0]
            pipe.step(input_ids=work.ids, labels=work.ids)
            pipe.zero_grad(set_to_none=True)
            collected[contender].append(_IN_COLLECTOR[0] - before)

        return step

    return build


def _row(name: str, times: list[float], collector: list[list[float]]) -> list[str]:
    ms = sorted(1000 * t for t in times)
    median = statistics.median(ms)
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    slow = sum(t > 1.3 * median for t in ms)
    per_rank = [f"{1000 * sum(c) / len(c):.1f}" for c in collector if c]
    full = [str(sum(t > 0.05 for t in c)) for c in collector]
    return [
        name, str(len(ms)), f"{statistics.fmean(ms):.0f}", f"{median:.0f}", f"{p90:.0f}",
        f"{ms[-1]:.0f}", str(slow), " / ".join(per_rank), " / ".join(full),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    schedule = "1f1b" if args.quick else "zb-v"  # --quick's 2 blocks make 2 stages only
    stats = Path(tempfile.mkdtemp(prefix="pipepar-bench-gc-"))
    spec = {"quick": args.quick, "schedule": schedule, "stats": str(stats)}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    before = common.load()
    with ProcessGroup(2, "benchmarks.bench_gc:rank_builder", spec, bind_cores=True) as group:
        for _ in range(args.rounds):
            for name in CONTENDERS:
                got = group.step_times(name, args.chunks, args.block, warmup=1)
                if isinstance(got, str):
                    raise SystemExit(f"{name}: {got}")
                times[name] += got
    ranks = [json.loads((stats / f"rank{r}.json").read_text()) for r in range(2)]
    header = [
        "contender", "steps", "mean ms", "median ms", "p90 ms", "longest ms", "paused",
        "in the collector, ms/step (rank 0 / 1)", "passes over 50 ms (rank 0 / 1)",
    ]  # fmt: skip
    rows = [_row(name, t, [r[name] for r in ranks]) for name, t in times.items()]
    table = markdown_table(header, rows)
    sizes = "quick sizes" if args.quick else "8 blocks x 256, 16 x 64 tokens"
    note = (
        f"Two ranks bound to a core each, transformers' GPT-2 ({sizes}), M={args.chunks}, "
        f"{schedule}; {args.rounds} rounds x {args.block} steps per contender, taking turns, "
        "each block after one untimed step; a step's time is the slower rank's, every step "
        "started after a barrier. paused: steps over 1.3 x the median. The collector's time is "
        "each rank's own, over every step it ran (untimed ones too). Machine load before: "
        f"{before}; after: {common.load()}."
    )
    print(table, note, sep="\n\n")
    if args.write:
        record(TITLE, table, notes=note, path=common.results_path(args, "gc"))
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=4)
    parser.add_argument("--block", type=int, default=25, help="timed steps per turn")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.block, args.chunks = 1, 2, 2
    return args


if __name__ == "__main__":
    raise SystemExit(main())
