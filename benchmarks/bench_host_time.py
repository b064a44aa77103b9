"""Host time per action: every schedule on layers so small that the library's own Python decides.

The job: 8 x (Linear(64, 64) + ReLU) (``--width``: other widths), batch 64, M = 16
micro-batches of 4 rows, forward + backward of an MSE loss, gradients set to None between steps,
no recompute, one math thread per stage or process, two stages (one per core; four of 2 layers,
two per core, for the virtual-stage schedules). An action (one stage's F, B or W of one
micro-batch) computes a few microseconds of arithmetic at width 64, so a step's time is mostly
what each action costs the host: the regime of a fast accelerator, where the kernels are short
and the Python around them is not.

Contenders (the timing is ``bench_schedules.py``'s, reused): the two references (**one core**:
the micro-batches one after another in this process; **limit**: that job in each of two
processes at once), every schedule of pipepar in one process (two worker threads) and across
two ranks (gloo, stage messages through shared memory), torchgpipe, a **hand-written** pipeline
across two ranks in pipepar's order of gpipe, 1f1b and zb-v (``benchmarks/_hand_pipeline.py``:
the blocks called directly, ``dist.isend``/``recv``; zb-v's B one ``autograd.grad`` to the stage
input and each Linear's output, its W the Linear's weight and bias terms), the same ZB-V with
W as a second engine pass (**hand-autograd**), the same actions on one thread in the schedule's
serial order with no messages (**hand-serial**: the schedule's torch calls alone), that ZB-V
with each split B also reading its stage's graph as pipepar does (**hand-serial-read**: the
floor of a library that finds the weight terms in the graph instead of knowing the layers) and
torch.distributed.pipelining's schedules, its zero-bubble ones included. Contenders alternate
in blocks of steps, each step is timed on its own (across ranks: a barrier before each, the
slower rank's time) and becomes a rate in samples/s; the table gives the p90 rate with the
p10-p90 spread.

Host time per action: the p90 step time over the actions one core runs (the step's actions /
2), and that as a multiple of the same runtime's 1F1B; *beyond the limit* subtracts what the
core computes (half the limit's step: each core holds half the model) before dividing, so it
is what a core spends per action on everything but the arithmetic (bubbles included).

Host CPU per step: the CPU seconds all threads of all the contender's processes spent in each
step (one process: ``time.process_time`` around the step; across ranks: each rank's, between
the barriers that time the step, summed), median and p10-p90, as a multiple of the same run's
plain one-core job's and of the runtime's 1F1B's, and per action beyond the plain job. Unlike
the rates, it does not depend on whether the second core was free when the step ran, so it is
the figure to compare on a shared machine (only mostly: a busy sibling core still slows each
instruction).

    python benchmarks/bench_host_time.py --write     # every contender, 200 steps each
    python benchmarks/bench_host_time.py --quick     # about a minute: a few contenders
    python benchmarks/bench_host_time.py --steps 60 --contenders pipepar:1f1b,pipepar:zb-v
    python benchmarks/bench_host_time.py --width 1024 --steps 48 --write --json w1024.json \
        --contenders pipepar.distributed:1f1b,pipepar.distributed:zb-v,hand:1f1b,hand:zb-v
    python benchmarks/bench_host_time.py --summary w64.json w256.json w1024.json --write

``--summary`` measures nothing: from runs' ``--json`` rows at several widths it writes each
runtime's ZB-V over its 1F1B and pipepar's 1F1B over its peers', step time and CPU per step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every thread (torchgpipe's too): one core
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks import bench_schedules as schedules
from benchmarks._results import markdown_table, record
from pipepar.core import named_schedules as pipepar_schedules
from pipepar.local import cpu_malloc

TITLE = "Host time per action: tiny layers (8 x Linear({width}), batch 64, M=16, 2 cores)"
"""The section's title; each ``--width`` writes a section of its own."""
WORKERS = 2
TORCH = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
HAND = ("gpipe", "1f1b", "zb-v")  # the hand-written pipeline plays pipepar's order of these
CONTENDERS = (
    *(f"pipepar:{s}" for s in pipepar_schedules.NAMES),
    "pipepar-workers:1f1b",
    "pipepar-workers:zb-v",
    "torchgpipe:gpipe",
    *(f"pipepar.distributed:{s}" for s in pipepar_schedules.NAMES),
    *(f"hand:{s}" for s in HAND),
    "hand-autograd:zb-v",
    "hand-serial:1f1b",
    "hand-serial:zb-v",
    "hand-serial-read:zb-v",
    *(f"torch:{s}" for s in TORCH),
)
QUICK = ("pipepar:1f1b", "pipepar:zb-v", "pipepar.distributed:1f1b", "torch:1F1B", "hand:zb-v")
ONE_F_ONE_B = {  # a runtime's 1F1B, the yardstick of its schedules' host time
    "pipepar": "pipepar:1f1b",
    "pipepar-workers": "pipepar-workers:1f1b",
    "pipepar.distributed": "pipepar.distributed:1f1b",
    "hand": "hand:1f1b",
    "hand-autograd": "hand:1f1b",  # the same 1F1B: it splits nothing
    "hand-serial": "hand-serial:1f1b",
    "hand-serial-read": "hand-serial:1f1b",  # the same 1F1B: it reads no graph
    "torch": "torch:1F1B",
}


def actions(key: str, m: int) -> int | None:
    """The actions (F, B and W of a stage and a micro-batch) of one step of contender ``key``;
    None for the references, which run no pipeline."""
    library, _, name = key.partition(":")
    if library in ("pipepar", "pipepar-workers", "pipepar.distributed") or library.startswith(
        "hand"
    ):
        if name not in pipepar_schedules.NAMES:
            return None
        stages = WORKERS * (2 if name in pipepar_schedules.VIRTUAL else 1)
        made = pipepar_schedules.make(name, stages, m, n_workers=WORKERS)
        return sum(len(work) for work in made.actions)
    if library == "torchgpipe":
        return 2 * WORKERS * m
    if library == "torch":  # virtual stages for all but GPipe and 1F1B; W apart in zero-bubble
        stages = WORKERS * (1 if name in ("GPipe", "1F1B") else 2)
        return stages * m * (3 if "ZeroBubble" in name else 2)
    return None


def host_rows(result: list[dict[str, Any]], batch: int, m: int) -> list[dict[str, Any]]:
    """``bench_schedules.rows`` with the host time per action added: ``actions``,
    ``us_per_action`` (p90 step / actions per core), ``x_1f1b`` (that of the runtime's 1F1B),
    ``step_x_1f1b`` (the p90 step of the runtime's 1F1B) and ``beyond_limit_us`` (per action,
    what the core does not spend on the arithmetic)."""
    by = {r["key"]: r for r in result}
    limit = by.get(schedules.LIMIT, {})
    compute = batch / limit["p90"] if limit.get("p90") else None  # half the limit's step
    out = []
    for row in result:
        n = actions(row["key"], m)
        extra: dict[str, Any] = {"actions": n, "us_per_action": None, "beyond_limit_us": None}
        if n and not row["error"]:
            step, per_core = batch / row["p90"], n / WORKERS
            extra["us_per_action"] = step / per_core * 1e6
            if compute is not None:
                extra["beyond_limit_us"] = (step - compute) / per_core * 1e6
        out.append(row | extra)
    for row in out:
        ref = by.get(ONE_F_ONE_B.get(row["key"].partition(":")[0], ""))
        yard = next((r for r in out if ref and r["key"] == ref["key"]), None)
        ok = yard is not None and row["us_per_action"] and yard["us_per_action"]
        row["x_1f1b"] = row["us_per_action"] / yard["us_per_action"] if ok else None  # type: ignore[index]
        row["step_x_1f1b"] = yard["p90"] / row["p90"] if ok else None  # type: ignore[index]
    return out


CPU_KEYS = ("cpu_ms", "cpu_p10_ms", "cpu_p90_ms", "cpu_x_plain", "cpu_x_1f1b", "cpu_beyond_us")


def with_cpu(result: list[dict[str, Any]], cpu: Mapping[str, list[float]]) -> list[dict[str, Any]]:
    """Each row of :func:`host_rows` with its CPU seconds per step (``cpu``: all threads of all
    its processes, per step) added: ``cpu_ms`` (median), ``cpu_p10_ms``, ``cpu_p90_ms``,
    ``cpu_x_plain`` (the median as a multiple of the plain one-core job's), ``cpu_x_1f1b`` (of
    the runtime's 1F1B's) and ``cpu_beyond_us`` (the median less the plain job's, per action).
    None where a row has no steps."""
    medians = {k: statistics.median(v) for k, v in cpu.items() if v}
    plain = medians.get(schedules.UNIT)
    out = []
    for row in result:
        extra: dict[str, Any] = dict.fromkeys(CPU_KEYS)
        steps = [] if row["error"] else cpu.get(row["key"], [])
        if steps:
            q = common.Quantiles.of(list(steps))
            extra |= {"cpu_ms": q.median * 1e3, "cpu_p10_ms": q.p10 * 1e3}
            extra["cpu_p90_ms"] = q.p90 * 1e3
            yard = medians.get(ONE_F_ONE_B.get(row["key"].partition(":")[0], ""))
            extra["cpu_x_1f1b"] = q.median / yard if yard else None
            if plain:
                extra["cpu_x_plain"] = q.median / plain
                n = row.get("actions")
                extra["cpu_beyond_us"] = (q.median - plain) / n * 1e6 if n else None
        out.append(row | extra)
    return out


def _cpu_cells(r: dict[str, Any]) -> list[str]:
    if r["cpu_ms"] is None:
        return ["-"] * 4
    cells = [f"{r['cpu_ms']:.1f} ({r['cpu_p10_ms']:.1f}-{r['cpu_p90_ms']:.1f})"]
    for key, form in (("cpu_x_plain", "{:.2f}x"), ("cpu_x_1f1b", "{:.2f}x"),
                      ("cpu_beyond_us", "{:.0f}")):  # fmt: skip
        cells.append("-" if r[key] is None else form.format(r[key]))
    return cells


def table(result: list[dict[str, Any]]) -> str:
    """The markdown table, one line per contender."""
    lines = []
    for r in result:
        head = [r["contender"], r["schedule"], r["processes"]]
        if r["error"]:
            lines.append([*head, *["-"] * 13, r["error"]])
            continue
        cells = [f"{r['p90']:.0f}", f"{r['spread']:.0%}", f"{r['x_one_core']:.2f}x"]
        cells.append("-" if r["of_limit"] is None else f"{r['of_limit']:.2f}")
        cells.append(r["actions"] or "-")
        for key, form in (
            ("us_per_action", "{:.0f}"),
            ("x_1f1b", "{:.2f}x"),
            ("step_x_1f1b", "{:.2f}x"),
        ):
            cells.append("-" if r[key] is None else form.format(r[key]))
        cells.append("-" if r["beyond_limit_us"] is None else f"{r['beyond_limit_us']:.0f}")
        lines.append(
            [*head, *cells, *_cpu_cells(r), schedules.LIBRARIES[r["key"].partition(":")[0]][2]]
        )
    headers = ["contender", "schedule", "processes", "samples/s p90", "spread p10-p90"]
    headers += ["x one core (p90)", "of limit (p90)", "actions", "us per action"]
    headers += ["x 1F1B per action", "x 1F1B per step", "beyond limit, us per action"]
    headers += ["CPU ms per step median (p10-p90)", "CPU x plain job", "CPU x 1F1B"]
    headers += ["CPU beyond plain job, us per action", "notes"]
    return markdown_table(headers, lines)


def notes(work: common.Workload, args: argparse.Namespace, before: str) -> str:
    block = -(-args.steps // args.rounds)
    return (
        f"Job: {work.description}, M={args.chunks}, mse loss, forward + backward, gradients set "
        "to None each step, checkpoint='never', one math thread per stage or process, two "
        "stages of 8 layers (virtual-stage schedules: four of 4, two per core). "
        f"{args.rounds} rounds x {block} timed steps per contender after {args.warmup} untimed "
        "step(s) per block, order rotating; across ranks a barrier before each step and the "
        "slower rank's time. Rate = samples per step / step time (limit: 2 x batch), p90 of "
        "the steps' rates, spread (p10-p90)/median. us per action: p90 step time / (actions / "
        "2 cores); x 1F1B: that, and the p90 step time, as a multiple of the same runtime's "
        "1F1B's; beyond limit: (p90 step time - half "
        "the limit's p90 step) / (actions / 2), what a core spends per action besides the "
        "arithmetic, bubbles included. CPU per step: the CPU seconds of all threads of all the "
        "contender's processes in the step (one process: time.process_time around the step; "
        "across ranks: each rank's, between the same barriers as the wall time, summed), median "
        "(p10-p90); x plain job: that median over the plain one-core job's median (the limit "
        "runs that job twice, so ~2x); x 1F1B: over the same runtime's 1F1B's; beyond plain job: "
        "(median - the plain job's median) / the step's actions. CPU time does not depend on "
        "whether the other core was free, so these columns are the ones to compare on a shared "
        "machine (other agents' jobs ran on this one). Machine load before: "
        f"{before}; after: {common.load()}."
    )


# -- the width sweep: ZB-V against 1F1B, pipepar against its peers, from runs' --json --------
SWEEP_TITLE = "Host time per action: ZB-V against 1F1B by layer width (M=16, 2 cores)"
PAIRS = {  # a runtime's (ZB-V, 1F1B)
    "pipepar.wrap (one process)": ("pipepar:zb-v", "pipepar:1f1b"),
    "pipepar.wrap, workers only": ("pipepar-workers:zb-v", "pipepar-workers:1f1b"),
    "pipepar.distributed": ("pipepar.distributed:zb-v", "pipepar.distributed:1f1b"),
    "hand-written, W as Linear terms": ("hand:zb-v", "hand:1f1b"),
    "hand-written, W by autograd": ("hand-autograd:zb-v", "hand:1f1b"),
    "hand-written, one thread, no messages": ("hand-serial:zb-v", "hand-serial:1f1b"),
    "hand-written, one thread, graph read": ("hand-serial-read:zb-v", "hand-serial:1f1b"),
    "torch.distributed.pipelining": ("torch:ZBVZeroBubble", "torch:1F1B"),
}
PEERS = {  # pipepar's 1F1B against a peer's, on the same processes
    "pipepar.wrap 1f1b / torchgpipe (one process)": ("pipepar:1f1b", "torchgpipe:gpipe"),
    "pipepar.distributed 1f1b / torch 1F1B": ("pipepar.distributed:1f1b", "torch:1F1B"),
    "pipepar.distributed 1f1b / hand-written 1f1b": ("pipepar.distributed:1f1b", "hand:1f1b"),
}


def _ratios(top: dict[str, Any], bottom: dict[str, Any]) -> list[str]:
    """Step time (median, p90: rates inverted) and CPU per step (median, p10) of ``top`` over
    ``bottom``."""
    step = [bottom[q] / top[q] for q in ("median", "p90")]
    cpu = [top[q] / bottom[q] for q in ("cpu_ms", "cpu_p10_ms")]
    return [f"{step[0]:.2f}x / {step[1]:.2f}x", f"{cpu[0]:.2f}x / {cpu[1]:.2f}x"]


def sweep_tables(rows: list[dict[str, Any]]) -> str:
    """Two markdown tables from the rows of runs at several widths (each row with ``width``):
    each runtime's ZB-V over its 1F1B, and pipepar's 1F1B over its peers'."""
    by = {(r["width"], r["key"]): r for r in rows if not r.get("error") and r.get("cpu_ms")}
    widths = sorted({w for w, _ in by})
    out = []
    for pairs, head in ((PAIRS, "runtime"), (PEERS, "pair")):
        lines = []
        for label, (top, bottom) in pairs.items():
            for w in widths:
                a, b = by.get((w, top)), by.get((w, bottom))
                if a is not None and b is not None:
                    lines.append([label, w, *_ratios(a, b)])
        headers = [head, "width", "step time median / p90", "CPU per step median / p10"]
        out.append(markdown_table(headers, lines))
    return "\n\n".join(out)


def summarize(args: argparse.Namespace) -> int:
    """The sweep's tables from ``--summary`` files; written with --write. 0 on success."""
    rows = [r for path in args.summary for r in json.loads(Path(path).read_text())]
    text = sweep_tables(rows)
    note = (
        "From the --json rows of bench_host_time.py runs at each width (the sections above, one "
        "per width): first table, each runtime's ZB-V over its own 1F1B; second, pipepar's 1F1B "
        "over a peer's on the same processes. Step time: the median and the p90 step rates "
        "inverted (wall time, which moves with the load of the shared machine); CPU per step: "
        "the ratio of the medians and of the p10s (all threads of all the contender's "
        f"processes). Files: {', '.join(Path(p).name for p in args.summary)}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        record(SWEEP_TITLE, text, notes=note, path=common.results_path(args, "host-sweep"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    if args.summary:
        return summarize(args)
    cpu_malloc.tune()  # the same allocator settings in every process (the ranks do the same)
    torch.set_num_threads(1)
    before = common.load()
    work = common.workload(common.TINY, width=args.width)
    cpu: dict[str, list[float]] = {}
    times = schedules.measure(work, args, cpu)
    result = with_cpu(host_rows(schedules.rows(times, work.batch), work.batch, args.chunks), cpu)
    text, note = table(result), notes(work, args, before)
    print(text, note, sep="\n\n")
    if args.write:
        record(
            TITLE.format(width=args.width),
            text,
            notes=note,
            path=common.results_path(args, "host-time"),
        )
    rows = [{k: v for k, v in r.items() if k != "rates"} | {"width": args.width} for r in result]
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=10)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches (M)")
    parser.add_argument("--width", type=int, default=64, help="features of each Linear layer")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    parser.add_argument(
        "--summary",
        type=Path,
        nargs="+",
        default=None,
        help="no measuring: the width sweep's tables from these runs' --json files",
    )
    parser.add_argument(
        "--contenders",
        type=lambda text: [p.strip() for p in text.split(",") if p.strip()],
        default=None,
        help="library:schedule list (libraries: "
        f"{', '.join(schedules.CHOSEN_BY_USER)}). Default: " + ",".join(CONTENDERS),
    )
    args = parser.parse_args(argv)
    args.contenders = args.contenders or list(QUICK if args.quick else CONTENDERS)
    bad = [c for c in args.contenders if c.partition(":")[0] not in schedules.CHOSEN_BY_USER]
    if bad:
        parser.error(f"unknown library in {bad}; use e.g. pipepar:1f1b or torch:1F1B")
    if args.quick:
        args.rounds, args.steps = 2, min(args.steps, 20)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
