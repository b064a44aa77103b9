"""Pipeline efficiency: every pipeline library on the same model, batch, balance and M, in one run.

For each workload, K stages and M micro-batches, the contenders train the same model (SGD,
``zero_grad(set_to_none=True)`` every step, ``checkpoint="never"``, one math thread per
device) and each is reported as a fraction of the bubble-limited ideal::

    ideal(K, M) = K * M / (M + K - 1) x (one device running the same M micro-batches
                                         one after another, forward + backward)

Contenders: pipepar.wrap (one process, a thread per stage), torchgpipe.GPipe (the same),
pipepar.distributed GPipe and 1F1B, torch.distributed.pipelining ScheduleGPipe and
Schedule1F1B (one process per stage, gloo). All of them, the one-device reference included,
alternate within every round (order rotating); the table gives medians over rounds and the
min-max spread. ``--device cuda`` puts stage j on ``cuda:j`` and the reference on ``cuda:0``, K up
to the number of GPUs; there the multi-process contenders are left out (this script runs them
on gloo; ``examples/hybrid_train.py`` prints ``pipepar.distributed``'s throughput on NCCL). With
``--defaults`` the two single-process libraries keep their own thread
defaults instead (pipepar: the cores shared among the stages that compute at once on average;
torchgpipe: torch's default count in every stage thread); the one-device reference keeps one thread.

    python benchmarks/bench_efficiency.py                   # full grid, writes RESULTS.md
    python benchmarks/bench_efficiency.py --models mlp --k 2 --m 8 --rounds 9
    python benchmarks/bench_efficiency.py --defaults --models mlp --k 2 --m 8 \
        --contenders pipepar,torchgpipe --rounds 15      # each library's own thread defaults
    python benchmarks/bench_efficiency.py --quick --json rows.json   # seconds, temp results
    python benchmarks/bench_efficiency.py --device cuda --models mlp,gpt   # K = 1, 2, 4, 8 GPUs
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every thread (torchgpipe's too): one core
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks import _contenders as contenders
from benchmarks._procs import ProcessGroup, close_groups, library_groups
from benchmarks._results import markdown_table, record

TITLE = "Pipeline efficiency: all contenders, one run"
TITLE_DEFAULTS = "Pipeline efficiency: single-process libraries at their thread defaults"
BASE = "one device"
THREADED = ("pipepar", "torchgpipe")
PROCS = {
    "pipepar.distributed": ("pipepar.distributed gpipe", "pipepar.distributed 1f1b"),
    "torch": ("torch pipelining gpipe", "torch pipelining 1f1b"),
}
CONTENDERS = (BASE, *THREADED, *(c for pair in PROCS.values() for c in pair))
FULL_GRID = {"mlp": ([1, 2], [1, 2, 4, 8, 16]), "alexnet": ([2], [4, 8]), "gpt": ([2], [4, 8])}
Step = common.Step


# -- rounds -----------------------------------------------------------------------------------
def _remote(group: ProcessGroup, name: str, m: int, steps: int) -> Callable[[], float]:
    def timed() -> float:
        answer = group.time(name, m, steps)
        if isinstance(answer, str):
            raise RuntimeError(answer)
        return answer

    return timed


def _applicable(name: str, k: int, m: int, groups: dict[str, ProcessGroup]) -> str | None:
    """Why ``name`` cannot run this configuration, or None."""
    lib = next((lib for lib, names in PROCS.items() if name in names), None)
    if lib is not None and lib not in groups:
        return "not selected"
    error = groups[lib].error if lib is not None else None
    if error is not None:
        return error.splitlines()[-1][:120]
    if name == "torch pipelining 1f1b" and m < k:
        return f"Schedule1F1B needs M >= K ({m} < {k})"
    return None


def measure(
    work: common.Workload,
    k: int,
    m: int,
    groups: dict[str, ProcessGroup],
    chosen: list[str],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One configuration: time every chosen contender in alternating rounds; rows per contender."""
    bal, devices = common.balance(work, k), common.stage_devices(args.device, k)
    timers: dict[str, Callable[[], float]] = {
        BASE: common.timer(common.accumulation_step(work, m, devices[0]), args.steps)
    }
    skipped: dict[str, str] = {}
    pipes = []
    for name in chosen:
        why = _applicable(name, k, m, groups)
        if why is not None:
            skipped[name] = why
        elif name in THREADED:
            step, pipe = contenders.threaded(name, work, bal, m, args.defaults, devices)
            step()  # warm-up (and worker start)
            timers[name] = common.timer(step, args.steps)
            pipes.append(pipe)
        else:
            lib = next(lib for lib, names in PROCS.items() if name in names)
            timers[name] = _remote(groups[lib], name, m, args.steps)
    timers[BASE]()  # warm-up
    times = _safe_rounds(timers, args.rounds, skipped)
    for pipe in pipes:
        getattr(pipe, "close", lambda: None)()
    return _rows(work, k, m, bal, times, skipped)


def _safe_rounds(
    timers: dict[str, Callable[[], float]], rounds: int, skipped: dict[str, str]
) -> dict[str, list[float]]:
    """Alternate; a contender that raises is dropped (its error noted) and the rest go on."""

    def guard(name: str, timer: Callable[[], float]) -> Callable[[], float]:
        def call() -> float:
            if name in skipped:
                return float("nan")
            try:
                return timer()
            except Exception as error:
                skipped[name] = f"error: {str(error).splitlines()[0][:160]}"
                return float("nan")

        return call

    raw = common.alternate({n: guard(n, t) for n, t in timers.items()}, rounds)
    return {n: v for n, v in raw.items() if n not in skipped}


def _rows(
    work: common.Workload,
    k: int,
    m: int,
    bal: list[int],
    times: dict[str, list[float]],
    skipped: dict[str, str],
) -> list[dict[str, Any]]:
    base = times[BASE]
    ideal = [b * (m + k - 1) / (k * m) for b in base]  # the ideal step time, per round
    rows = []
    for name, seconds in times.items():
        stats = common.Stats.of(seconds)
        frac = common.Stats.of([i / s for i, s in zip(ideal, seconds)])
        rows.append(
            {
                "workload": work.name,
                "k": k,
                "m": m,
                "balance": bal,
                "contender": name,
                "step_ms": stats.median * 1e3,
                "samples_per_s": work.batch / stats.median,
                "spread": stats.spread(),
                "of_ideal": frac.median,
                "of_ideal_low": frac.low,
                "of_ideal_high": frac.high,
                "rounds": len(seconds),
                "error": None,
            }
        )
    rows += [
        {"workload": work.name, "k": k, "m": m, "balance": bal, "contender": name, "error": why}
        for name, why in skipped.items()
    ]
    return rows


# -- report -----------------------------------------------------------------------------------
def _ratio(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """Throughput of ``a`` over ``b`` (b: the better of several, by prefix), per configuration."""
    got = {r["contender"]: r for r in rows if r.get("error") is None}
    rivals = [r for n, r in got.items() if n.startswith(b)]
    if a not in got or not rivals:
        return "-"
    return f"{got[a]['samples_per_s'] / max(r['samples_per_s'] for r in rivals):.2f}x"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one line per workload, K, M and contender."""
    lines = []
    for r in rows:
        head = [r["workload"], r["k"], r["m"], r["contender"]]
        if r.get("error"):
            lines.append([*head, "-", "-", "-", r["error"]])
            continue
        ideal = (
            "-"
            if r["contender"] == BASE
            else (f"{r['of_ideal']:.2f} ({r['of_ideal_low']:.2f}-{r['of_ideal_high']:.2f})")
        )
        lines.append(
            [*head, f"{r['samples_per_s']:.0f}", f"{r['step_ms']:.1f}", f"{r['spread']:.0%}", ideal]
        )
    headers = [
        "model",
        "K",
        "M",
        "contender",
        "samples/s",
        "step ms",
        "spread",
        "of ideal (min-max)",
    ]
    return markdown_table(headers, lines)


def targets(rows: list[dict[str, Any]], defaults: bool) -> str:
    """The issue's targets at K=2, M=8 on the MLP, from this run's medians."""
    if defaults:
        return "Targets are judged at one math thread per stage (run without --defaults)."
    at = [r for r in rows if (r["workload"], r["k"], r["m"]) == ("mlp", 2, 8)]
    ours = next((r for r in at if r["contender"] == "pipepar" and not r.get("error")), None)
    if ours is None:
        return "Targets (MLP, K=2, M=8): not measured in this run."
    return (
        f"Targets (MLP, K=2, M=8): pipepar at {ours['of_ideal']:.2f} of ideal (target >= 0.80); "
        f"{_ratio(at, 'pipepar', 'torchgpipe')} torchgpipe (target >= 1.5x); "
        f"{_ratio(at, 'pipepar', 'torch pipelining')} the better torch.distributed.pipelining "
        "schedule (target >= 1.2x)."
    )


def _grid(args: argparse.Namespace) -> dict[str, tuple[list[int], list[int]]]:
    base = {"mlp": ([2], [1, 2])} if args.quick else FULL_GRID
    if args.device == "cuda":  # every power of two up to the number of GPUs
        gpus = torch.cuda.device_count()
        base = {n: ([k for k in (1, 2, 4, 8) if k <= gpus], ms) for n, (_, ms) in base.items()}
    return {n: (args.k or ks, args.m or ms) for n, (ks, ms) in base.items() if n in args.models}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration of the grid; process groups live for one workload and K."""
    rows: list[dict[str, Any]] = []
    for name, (ks, ms) in _grid(args).items():
        work = common.workload(name, quick=args.quick)
        for k in ks:
            spec = {"workload": name, "quick": args.quick, "balance": common.balance(work, k)}
            groups = library_groups(
                (lib for lib, names in PROCS.items() if set(names) & set(args.contenders)),
                partial(ProcessGroup, k, "benchmarks._contenders:stage_builder", spec),
                shared=args.quick,
            )
            try:
                for m in ms:
                    rows += measure(work, k, m, groups, args.contenders, args)
                    print(table(rows[-len(args.contenders) - 1 :]), flush=True)
            finally:
                close_groups(groups)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the grid, print and record the table; 0 on success."""
    args = _parse(argv)
    before = common.load()
    rows = run(args)
    works = {n: common.workload(n, quick=args.quick).description for n in _grid(args)}
    notes = "\n".join(
        [
            targets(rows, args.defaults),
            "",
            "Workloads: " + "; ".join(f"{n}: {d}" for n, d in works.items()) + ".",
            f"{args.rounds} alternating rounds x {args.steps} timed steps per contender (after one "
            "warm-up step); SGD with zero_grad(set_to_none=True) every step; checkpoint='never'; "
            f"{_threads_note(args.defaults)}; "
            "balance = exact min-max split of forward FLOPs. Of ideal = (one device's step x "
            "(M+K-1)/(K*M)) / the contender's step, per round. Spread = (max-min)/median of the "
            f"step time. Machine load before: {before}; after: {common.load()}.",
        ]
    )
    text = table(rows)
    print(text, notes, sep="\n\n")
    title = (TITLE_DEFAULTS if args.defaults else TITLE) + (
        f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""
    )
    record(title, text, notes=notes, path=common.results_path(args, "efficiency"))
    common.write_json(args.json, rows)
    return 0


def _threads_note(defaults: bool) -> str:
    if defaults:
        return (
            "each library's thread defaults (pipepar: the cores shared among the stages that "
            "compute at once on average, torchgpipe: "
            f"{contenders.DEFAULT_THREADS} per stage thread; one-device reference: 1)"
        )
    return f"one math thread per stage (this process: {torch.get_num_threads()})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--models", type=_names, default=list(common.WORKLOADS))
    parser.add_argument("--k", type=_ints, default=None, help="stages, e.g. 1,2")
    parser.add_argument("--m", type=_ints, default=None, help="micro-batches, e.g. 1,2,4,8,16")
    parser.add_argument(
        "--contenders",
        type=_names,
        default=list(CONTENDERS[1:]),
        help="comma-separated subset of: " + ", ".join(CONTENDERS[1:]),
    )
    parser.add_argument(
        "--defaults", action="store_true", help="pipepar and torchgpipe at their thread defaults"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="stage devices")
    args = parser.parse_args(argv)
    unknown = set(args.contenders) - set(CONTENDERS) | set(args.models) - set(common.WORKLOADS)
    if unknown:
        parser.error(f"unknown contender or model {sorted(unknown)}; see --help")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible; use --device cpu")
        args.contenders = [c for c in args.contenders if c in THREADED]
    if args.quick:
        args.rounds, args.steps = min(args.rounds, 2), 1
    return args


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    return [int(part) for part in _names(text)]


if __name__ == "__main__":
    raise SystemExit(main())
