"""Every pipeline schedule on one job: pipepar vs torch.distributed.pipelining vs torchgpipe.

The job: 8 x (Linear(1024, 1024) + ReLU), batch 256, M = 8 micro-batches, forward + backward of
an MSE loss against a fixed random target, gradients set to None between steps (no optimizer),
no recompute, one math thread per stage or process. Two stages of 8 layers, one per core; the
virtual-stage schedules take four stages of 4 layers, two per core.

Two references, measured in the same run as everything else:

- **one core**: the same 8 micro-batches one after another in this process, one thread (1.0x);
- **limit**: that job in each of two processes at once, a barrier around each step; twice its
  rate is what the two cores do together while they share caches and memory bandwidth, below
  2x one core. Each contender is reported as a fraction of this limit.

The machine is noisy, so contenders alternate: each runs a block of steps per round, the order
rotating from round to round, so a slow drift on the host hits all alike. Every step is timed
on its own (multi-process: all ranks start it after a barrier; its time is the slowest rank's)
and turned into a rate in samples/s. The table gives the median and the 90th percentile (a
fast but typical step) of those rates and their p10-p90 spread; the fractions compare p90 with
p90 (median with median in brackets). How sure a fraction is comes from a bootstrap: both
contenders' steps are redrawn with replacement 2000 times and the central 90% of the p90 ratios
is the interval. The note under the table compares pipepar's best schedule with torch's best the
same way: a lead counts only when its whole interval lies above 1.

    python benchmarks/bench_schedules.py --write       # every contender, 60 steps each
    python benchmarks/bench_schedules.py --steps 15 --rounds 2 \\
        --contenders pipepar:1f1b,pipepar:zb-v,torch:1F1B,torch:ZBVZeroBubble
    python benchmarks/bench_schedules.py --quick       # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every thread (torchgpipe's too): one core
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks import _contenders as contenders
from benchmarks._procs import ProcessGroup, close_groups, library_groups
from benchmarks._results import record
from pipepar.local import cpu_malloc

TITLE = "Schedules: pipepar vs torch.distributed.pipelining vs torchgpipe (MLP, 2 cores, M=8)"
"""The section's title at the default M; another ``--chunks`` writes a section of its own."""
UNIT, LIMIT = "one core:", "limit:"
PIPEPAR = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
LIBRARIES = {  # library: (label, processes, notes)
    "one core": ("one core (reference)", 1, "the micro-batches one after another"),
    "limit": ("limit: one-core job x 2 processes", 2, "physical limit of the 2 cores"),
    "pipepar": ("pipepar.wrap, pipe.step", 1, "workers or the calling thread, as timed"),
    "pipepar-workers": ("pipepar.wrap, workers only", 1, "one thread per core"),
    "pipepar-call": ("pipepar.wrap, pipe(x) + backward", 1, "all forwards, then backward"),
    "torchgpipe": ("torchgpipe.GPipe", 1, "both 'cpu' stages on one thread (one per device)"),
    "pipepar.distributed": ("pipepar.distributed", 2, "gloo, stage messages through shared memory"),
    "torch": ("torch.distributed.pipelining", 2, "gloo"),
    "hand": ("hand-written pipeline", 2, "gloo isend/recv, pipepar's order; W: Linear terms"),
    "hand-autograd": ("hand-written, W by autograd", 2, "as hand, W an engine pass to the weights"),
    "hand-serial": ("hand-written, one thread", 1, "all stages on one thread, no messages"),
    "hand-serial-read": (
        "hand-written, one thread, graph read",
        1,
        "as hand-written one thread; each split B also reads its graph as pipepar does",
    ),
}
REMOTE = ("limit", "pipepar.distributed", "torch", "hand", "hand-autograd")
CHOSEN_BY_USER = (
    "pipepar",
    "pipepar-workers",
    "pipepar-call",
    "torchgpipe",
    "pipepar.distributed",
    "torch",
    *REMOTE[3:],
    "hand-serial",
    "hand-serial-read",
)
CONTENDERS = (
    *(f"pipepar:{s}" for s in PIPEPAR),
    "pipepar-call:gpipe",
    "torchgpipe:gpipe",
    *(f"pipepar.distributed:{s}" for s in PIPEPAR),
    *(f"torch:{s}" for s in contenders.TORCH_SCHEDULES),
)
QUICK = ("pipepar:1f1b", "pipepar.distributed:1f1b", "torch:1F1B")


# -- contenders --------------------------------------------------------------------------------
Block = common.Block
_local, _remote, _guard = common.local_block, common.remote_block, common.guard  # shared


def _blocks(
    work: common.Workload,
    groups: dict[str, ProcessGroup],
    args: argparse.Namespace,
    cpu: dict[str, list[float]] | None,
) -> tuple[dict[str, Block], dict[str, str], list[Any]]:
    """A block timer per contender (the references first), the contenders that could not be
    built (with why), and the in-process pipes (to close). ``cpu``: where each contender's
    CPU seconds per step go (all threads; across ranks, all ranks' summed)."""
    block, m = math.ceil(args.steps / args.rounds), args.chunks

    def sink(key: str) -> list[float] | None:
        return None if cpu is None else cpu.setdefault(key, [])

    unit = common.accumulation_step(work, m, optimizer=False)
    unit()  # warm-up
    timers = {UNIT: _local(unit, block, args.warmup, sink(UNIT))}
    skipped: dict[str, str] = {}
    pipes = []
    for key in (LIMIT, *args.contenders):
        library, _, schedule = key.partition(":")
        if library in REMOTE:
            timers[key] = _remote(groups[library], key, m, block, args.warmup, sink(key))
            continue
        try:
            step, pipe = contenders.one_process(library, schedule, work, m)
            pipes.append(pipe)
            step()  # warm-up (and worker start)
        except Exception as error:
            skipped[key] = _why(error)
            continue
        timers[key] = _local(step, block, args.warmup, sink(key))
    return timers, skipped, pipes


_why = common.why


def measure(
    work: common.Workload, args: argparse.Namespace, cpu: dict[str, list[float]] | None = None
) -> dict[str, list[float] | str]:
    """Per contender: the seconds of every timed step, or why it has none. ``cpu``: filled with
    each contender's CPU seconds per step (all threads of all its processes)."""
    spec = {"workload": work.name, "quick": args.quick, "width": getattr(args, "width", None)}
    wanted = {LIMIT.rstrip(":")} | {k.partition(":")[0] for k in args.contenders}
    groups = library_groups(
        (lib for lib in REMOTE if lib in wanted),
        partial(ProcessGroup, 2, "benchmarks._contenders:schedule_builder", spec),
        shared=args.quick,
    )
    try:
        timers, skipped, pipes = _blocks(work, groups, args, cpu)
        times = common.run_blocks(timers, skipped, args.rounds, (UNIT, LIMIT, *args.contenders))
    finally:
        close_groups(groups)
    for pipe in pipes:
        getattr(pipe, "close", lambda: None)()
    return times


# -- report ------------------------------------------------------------------------------------
def rows(times: dict[str, list[float] | str], batch: int) -> list[dict[str, Any]]:
    """One row per contender: rate quantiles, x one core and fraction of the limit."""
    samples = {k: batch * (2 if k == LIMIT else 1) for k in times}
    stats = common.against_limit(times, samples, UNIT, LIMIT)
    out = []
    for key in times:
        library, _, schedule = key.partition(":")
        label, processes, _ = LIBRARIES[library]
        row: dict[str, Any] = {"key": key, "contender": label, "schedule": schedule or "-"}
        out.append(row | {"processes": processes} | stats[key])
    return out


def lead(result: list[dict[str, Any]]) -> str:
    """pipepar's best schedule against torch.distributed.pipelining's best, p90 rates, with a
    bootstrap interval: the lead is real only if the whole interval lies above 1."""
    best = {}
    for lib in ("pipepar", "torch"):
        mine = [r for r in result if r["key"].startswith(lib + ":") and not r["error"]]
        if not mine:
            return ""
        best[lib] = max(mine, key=lambda r: r["p90"])
    a, b = best["pipepar"], best["torch"]
    lo, hi = common.ratio_interval(a["rates"], b["rates"])
    verdict = "ahead beyond the uncertainty" if lo > 1 else "not ahead beyond the uncertainty"
    return (
        f"pipepar's best ({a['schedule']}) / torch's best ({b['schedule']}), p90 rates: "
        f"{a['p90'] / b['p90']:.2f} (90% interval {lo:.2f}-{hi:.2f}): {verdict}."
    )


def table(result: list[dict[str, Any]]) -> str:
    """The markdown table, one line per contender."""
    return common.limit_table(result, lambda r: LIBRARIES[r["key"].partition(":")[0]][2])


def notes(work: common.Workload, args: argparse.Namespace, before: str) -> str:
    block = math.ceil(args.steps / args.rounds)
    return (
        f"Job: {work.description}, M={args.chunks}, mse loss, forward + backward, gradients set "
        "to None each step, checkpoint='never', one math thread per stage or process. Balance "
        f"{contenders.even_balance(len(work.model), 2)} layers; virtual-stage schedules "
        f"{contenders.even_balance(len(work.model), 4)}, two stages per core (torch: looped, "
        "rank r holds stages r and r+2; ZBVZeroBubble and DualPipeV V-shaped, rank 0 holds "
        f"stages 0 and 3). {args.rounds} rounds x {block} timed steps per contender after "
        f"{args.warmup} untimed step(s) per block, order rotating; a step's time on two "
        "processes is the slower rank's, every step started after a barrier. Rate = samples "
        "per step / step time (limit: 2 x batch). x one core and of limit compare p90 rates "
        "(medians in brackets) with the same run's one core and limit; the interval is a "
        "bootstrap of that p90 ratio (2000 redraws of both contenders' steps), how sure the "
        "fraction is, where the spread says how much single steps vary. Every process runs "
        "with pipepar's malloc thresholds (pipepar.local.cpu_malloc; PIPEPAR_TUNE_MALLOC=0 "
        f"turns them off everywhere). Machine load before: {before}; after: {common.load()}."
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    cpu_malloc.tune()  # the same allocator settings in every process (the ranks do the same)
    torch.set_num_threads(1)
    before = common.load()
    work = common.workload("mlp", quick=args.quick)
    result = rows(measure(work, args), work.batch)
    text, note = table(result), " ".join(filter(None, [lead(result), notes(work, args, before)]))
    print(text, note, sep="\n\n")
    if args.write:
        title = TITLE.replace("M=8", f"M={args.chunks}")
        record(title, text, notes=note, path=common.results_path(args, "schedules"))
    common.write_json(args.json, [{k: v for k, v in r.items() if k != "rates"} for r in result])
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=10)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per block")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    parser.add_argument(
        "--contenders",
        type=lambda text: [p.strip() for p in text.split(",") if p.strip()],
        default=None,
        help=f"library:schedule list (libraries: {', '.join(CHOSEN_BY_USER)}); unknown "
        "schedules are reported n/a. Default: " + ",".join(CONTENDERS),
    )
    args = parser.parse_args(argv)
    args.contenders = args.contenders or list(QUICK if args.quick else CONTENDERS)
    bad = [c for c in args.contenders if c.partition(":")[0] not in CHOSEN_BY_USER]
    if bad:
        parser.error(f"unknown library in {bad}; use e.g. pipepar:1f1b or torch:ZBVZeroBubble")
    if args.quick:
        args.rounds, args.steps = 1, min(args.steps, 3)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
