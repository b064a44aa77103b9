"""What the time limit on waits costs a step: ``ppd.wrap(..., timeout=300)`` (the default: every
wait bounded, each rank's progress published for stall reports) vs ``timeout=None`` (neither).

Two ranks (gloo on localhost, one math thread each) build every job three times: with the
default timeout, with ``timeout=None``, and with the default again (the control: two pipes that
differ only in where their tensors sit in memory differ by this much). They are timed in blocks
of steps: each round runs every job (their order rotating), each job's three pipes back to back
(their order rotating too), so that a load change on the shared machine hits all three alike.
Every step starts after a barrier on both ranks and its time is the slower rank's. Jobs:

- **small**: 8 x (Linear(64, 64) + ReLU), batch 64, M=16, 1f1b: short steps of many waits
  (each rank waits for 16 activations or gradients a step), where a cost per wait would show;
- **mlp**: the benchmarks' MLP, 8 x (Linear(1024, 1024) + ReLU), batch 256, M=8, 1f1b;
- **gpt2**: transformers' GPT-2 (tiny, tied head) through the any-model route, M=4, 1f1b.

The table gives the median step time of each pipe, the ratio with the limit over without it
(of the medians and of the p10 steps: fast but typical ones), and the control's ratio, each
with a bootstrap interval (2000 redraws of both pipes' steps; the central 90% of the ratios):
the limit costs nothing measurable when its ratio lies as close to 1 as the control's.

    python benchmarks/bench_timeout.py --write          # every job, 300 steps per setting
    python benchmarks/bench_timeout.py --jobs small --steps 600 --rounds 20
    python benchmarks/bench_timeout.py --quick          # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record

TITLE = "Time limit on waits: timeout=300 (default) vs timeout=None (2 ranks, gloo)"
JOBS = ("small", "mlp", "gpt2")
SETTINGS = {"on": 300.0, "off": None, "control": 300.0}  # what wrap's timeout= gets
CHUNKS = {"small": 16, "mlp": 8, "gpt2": 4}


# -- the ranks' side ---------------------------------------------------------------------------
def builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], common.Step]:
    """Factory run on every rank of a ProcessGroup: ``build("job:setting", m) -> step``."""

    def build(contender: str, m: int) -> common.Step:
        job, _, setting = contender.partition(":")
        if job == "gpt2":
            return _gpt2(m, SETTINGS[setting], spec["quick"])
        return _sequential(job, m, SETTINGS[setting], spec["quick"])

    return build


def _sequential(job: str, m: int, timeout: float | None, quick: bool) -> common.Step:
    import pipepar.distributed as ppd

    if job == "mlp":
        work = common.workload("mlp", quick=quick)
        model, x, y = copy.deepcopy(work.model), work.x, work.y
    else:
        width, batch = (16, 32) if quick else (64, 64)
        torch.manual_seed(0)
        layers = [layer for _ in range(8) for layer in (nn.Linear(width, width), nn.ReLU())]
        model = nn.Sequential(*layers)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
    half = len(model) // 2
    pipe = ppd.wrap(
        model, [half, half], chunks=m, schedule="1f1b", checkpoint="never", timeout=timeout
    )

    def step() -> None:
        pipe.step(x, y, nn.functional.mse_loss)
        pipe.zero_grad(set_to_none=True)

    return step


def _gpt2(m: int, timeout: float | None, quick: bool) -> common.Step:
    import pipepar.distributed as ppd
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    model = zoo.gpt2(layers=2 if quick else 4)
    split = "transformer.h.1" if quick else "transformer.h.2"
    pipe = ppd.wrap(model, split=[split], chunks=m, schedule="1f1b", timeout=timeout)
    batch = zoo.sample("gpt2", batch=8, seq=16)

    def step() -> None:
        pipe.step(**batch)
        pipe.zero_grad(set_to_none=True)

    return step


# -- measuring ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of every timed step, per ``"job:setting"``."""
    block = math.ceil(args.steps / args.rounds)
    group = ProcessGroup(2, "benchmarks.bench_timeout:builder", {"quick": args.quick})
    try:
        if group.error is not None:
            raise RuntimeError(group.error)
        timers = {
            f"{job}:{setting}": _timer(group, f"{job}:{setting}", CHUNKS[job], block, args.warmup)
            for job in args.jobs
            for setting in SETTINGS
        }
        return paired(timers, args.jobs, args.rounds)
    finally:
        group.close()


def paired(
    timers: dict[str, Callable[[], list[float]]], jobs: Sequence[str], rounds: int
) -> dict[str, list[float]]:
    """Every job once per round, in rotating order, its settings back to back, their order
    rotating too; every timed step per ``"job:setting"``.

    Example:
        >>> seen = []
        >>> timers = {f"a:{s}": (lambda s=s: seen.append(s) or [1.0]) for s in SETTINGS}
        >>> paired(timers, ["a"], 2)["a:on"], seen
        ([1.0, 1.0], ['on', 'off', 'control', 'off', 'control', 'on'])
    """
    out: dict[str, list[float]] = {key: [] for key in timers}
    names, settings = list(jobs), list(SETTINGS)
    for r in range(rounds):
        for k, job in enumerate(_rotated(names, r)):
            for setting in _rotated(settings, r + k):
                out[f"{job}:{setting}"] += timers[f"{job}:{setting}"]()
    return out


def _rotated(items: list[str], by: int) -> list[str]:
    return items[by % len(items) :] + items[: by % len(items)]


def _timer(
    group: ProcessGroup, key: str, m: int, block: int, warmup: int
) -> Callable[[], list[float]]:
    def timed() -> list[float]:
        answer = group.step_times(key, m, block, warmup)
        if isinstance(answer, str):
            raise RuntimeError(f"{key}: {answer}")
        return answer

    return timed


def p10(values: Sequence[float]) -> float:
    """The 10th percentile (inclusive method)."""
    return common.Quantiles.of(list(values)).p10


# -- report ------------------------------------------------------------------------------------
def rows(times: dict[str, list[float]], jobs: Sequence[str]) -> list[dict[str, Any]]:
    """Per job: each pipe's step-time quantiles; the on/off and on/control ratios of the
    medians and of the p10 steps, with their intervals."""
    out = []
    for job in jobs:
        on, off, control = (times[f"{job}:{s}"] for s in SETTINGS)
        row: dict[str, Any] = {"job": job, "m": CHUNKS[job], "steps": len(on)}
        for name in SETTINGS:
            q = common.Quantiles.of(times[f"{job}:{name}"])
            row |= {f"{name}_median_ms": q.median * 1e3, f"{name}_p10_ms": q.p10 * 1e3}
        for name, top, bottom, stat in (
            ("median", on, off, statistics.median),
            ("control_median", on, control, statistics.median),
            ("p10", on, off, p10),
            ("control_p10", on, control, p10),
        ):
            row[f"ratio_{name}"] = stat(top) / stat(bottom)
            row[f"ratio_{name}_interval"] = common.ratio_interval(top, bottom, stat)
        out.append(row)
    return out


def table(result: list[dict[str, Any]]) -> str:
    """The markdown table, one line per job."""
    lines = []
    for r in result:
        medians = " / ".join(f"{r[f'{name}_median_ms']:.2f}" for name in SETTINGS)
        ratios = [_ratio(r, name) for name in ("median", "control_median", "p10", "control_p10")]
        lines.append([r["job"], r["m"], r["steps"], medians, *ratios])
    headers = ["job", "M", "steps per pipe", "step ms median: on / off / control"]
    headers += ["on/off, medians (90% interval)", "on/control, medians (90% interval)"]
    headers += ["on/off, p10 steps (90% interval)", "on/control, p10 steps (90% interval)"]
    return markdown_table(headers, lines)


def _ratio(row: dict[str, Any], name: str) -> str:
    lo, hi = row[f"ratio_{name}_interval"]
    return f"{row[f'ratio_{name}']:.3f} ({lo:.3f}-{hi:.3f})"


def notes(args: argparse.Namespace, before: str) -> str:
    block = math.ceil(args.steps / args.rounds)
    return (
        f"{args.rounds} rounds x {block} timed steps per pipe after {args.warmup} untimed "
        "step(s) per block; each round runs every job (order rotating), its three pipes back "
        "to back (order rotating); a step's time is the slower rank's, every step started "
        "after a barrier; all pipes live in the same two processes (a pipe with a timeout has "
        "a progress thread that looks every timeout / 10 and writes to the store only when its "
        "rank moved). A ratio above 1 means slower with the limit; the interval is a bootstrap of "
        "the ratio (2000 redraws of both pipes' steps). "
        f"Machine load before: {before}; after: {common.load()}."
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    torch.set_num_threads(1)
    before = common.load()
    result = rows(measure(args), args.jobs)
    text, note = table(result), notes(args, before)
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "timeout"))
    common.write_json(args.json, result)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=10)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    parser.add_argument(
        "--jobs",
        type=lambda text: [j.strip() for j in text.split(",") if j.strip()],
        default=None,
        help=f"comma-separated, of {', '.join(JOBS)} (default: all; --quick: small)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 8, 2, 1
    args.jobs = args.jobs or (["small"] if args.quick else list(JOBS))
    unknown = [j for j in args.jobs if j not in JOBS]
    if unknown:
        parser.error(f"unknown job(s) {unknown}; choose from {', '.join(JOBS)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
