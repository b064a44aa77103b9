"""What the pipeline machinery itself costs, on one device where there is nothing to overlap.

Three comparisons, each a pair of contenders timed in the same alternating rounds:

- ``wrap(model, [L], chunks=1)`` against the plain model (target: <= 2% slower);
- ``wrap(model, [L], chunks=M)`` against gradient accumulation over the same M micro-batches
  on one device (the micro-batching itself is not pipepar's cost; what pipepar adds is);
- ``trace=True`` against ``trace=False``: with nothing to recompute, a one-stage pipe without a
  tracer runs on plain autograd, and a tracer sends it through the per-micro-batch engine, so
  this compares the engine with plain autograd; with ``checkpoint="always"`` both go through
  the engine and the difference is the recording alone.

Each step is forward + backward + SGD step + ``zero_grad(set_to_none=True)``. Overhead is
the median over rounds of (pipepar's step / the reference's step in the same round) - 1; the
"per action" column spreads the absolute difference over the 2M actions (F and B per
micro-batch) of a step, which is what a tiny model exposes.

    python benchmarks/bench_overhead.py                # writes benchmarks/RESULTS.md
    python benchmarks/bench_overhead.py --quick --json rows.json   # seconds, temp results
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks._results import markdown_table, record

TITLE = "Overhead on one device"
Step = common.Step


def _step(module: nn.Module, work: common.Workload) -> Step:
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> None:
        work.loss(module(work.x), work.y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _wrapped(
    work: common.Workload, m: int, *, trace: bool = False, checkpoint: str | None = None
) -> Step:
    # checkpoint="never" for M > 1 by default: recomputing trades time for memory, it is not
    # overhead. (With nothing to recompute and no tracer, a one-stage pipe runs on plain
    # autograd; a tracer or recomputation sends it through the per-micro-batch engine.)
    if checkpoint is None:
        checkpoint = "except_last" if m == 1 else "never"
    pipe = pipepar.wrap(
        copy.deepcopy(work.model),
        [len(work.model)],
        devices=["cpu"],
        chunks=m,
        checkpoint=checkpoint,
        trace=trace,
    )
    step = _step(pipe, work)
    if not trace:
        return step

    def traced() -> None:
        step()
        assert pipe.tracer is not None
        pipe.tracer.clear()  # keep the recording from growing across steps

    return traced


def pairs(work: common.Workload, ms: list[int]) -> list[tuple[str, int, Step, Step]]:
    """(comparison, M, reference step, pipepar step) for one workload."""
    plain = _step(copy.deepcopy(work.model), work)
    out = [("wrap([L], chunks=1) vs plain model", 1, plain, _wrapped(work, 1))]
    out += [
        (
            f"wrap([L], chunks={m}) vs accumulation over {m}",
            m,
            common.accumulation_step(work, m),
            _wrapped(work, m),
        )
        for m in ms
    ]
    m = ms[-1]
    out.append(
        (
            f"trace=True vs trace=False, chunks={m} (engine vs plain autograd)",
            m,
            _wrapped(work, m),
            _wrapped(work, m, trace=True),
        )
    )
    out.append(
        (
            f"trace=True vs trace=False, chunks={m}, checkpoint='always' (recording only)",
            m,
            _wrapped(work, m, checkpoint="always"),
            _wrapped(work, m, trace=True, checkpoint="always"),
        )
    )
    return out


def measure(work: common.Workload, ms: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every pair's two contenders in the same alternating rounds; one row per pair."""
    cases = pairs(work, ms)
    timers: dict[str, Callable[[], float]] = {}
    for i, (_, _, ref_step, our_step) in enumerate(cases):
        for role, step in (("ref", ref_step), ("ours", our_step)):
            step()  # warm-up
            timers[f"{i}:{role}"] = common.timer(step, args.steps)
    times = common.alternate(timers, args.rounds)
    rows = []
    for i, (name, m, _, _) in enumerate(cases):
        ref, ours = times[f"{i}:ref"], times[f"{i}:ours"]
        ratio = common.Stats.of([b / a - 1 for a, b in zip(ref, ours)])
        diff = statistics.median(b - a for a, b in zip(ref, ours))
        rows.append(
            {
                "workload": work.name,
                "comparison": name,
                "m": m,
                "reference_ms": statistics.median(ref) * 1e3,
                "pipepar_ms": statistics.median(ours) * 1e3,
                "overhead": ratio.median,
                "overhead_low": ratio.low,
                "overhead_high": ratio.high,
                "us_per_action": diff / (2 * m) * 1e6,
                "rounds": len(ref),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table, one line per workload and comparison."""
    lines = [
        [
            r["workload"],
            r["comparison"],
            f"{r['reference_ms']:.2f}",
            f"{r['pipepar_ms']:.2f}",
            f"{r['overhead']:+.1%} ({r['overhead_low']:+.1%}..{r['overhead_high']:+.1%})",
            f"{r['us_per_action']:+.0f}",
        ]
        for r in rows
    ]
    headers = [
        "model",
        "comparison",
        "reference ms",
        "pipepar ms",
        "overhead (min..max)",
        "us per action",
    ]
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print and record the overhead table; 0 on success."""
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    before = common.load()
    works = [common.workload("mlp", quick=args.quick)]
    small = common.workload("mlp", quick=True)
    small.name, small.description = "mlp-tiny", "tiny " + small.description
    if not args.quick:
        works.append(small)  # so small that the fixed per-action cost shows
    ms = [2] if args.quick else [4, 8]
    rows = [row for work in works for row in measure(work, ms, args)]
    first = rows[0]
    verdict = "met" if first["overhead"] <= 0.02 else "missed"
    notes = (
        f"Target: wrap([L], chunks=1) at most 2% slower than the plain model: {verdict} "
        f"({first['overhead']:+.1%} on {first['workload']}).\n\n"
        + "; ".join(f"{w.name}: {w.description}" for w in works)
        + f". {args.rounds} alternating rounds x {args.steps} steps; {args.threads} math "
        f"thread(s); chunks=1 runs the default checkpoint='except_last' (one micro-batch: nothing "
        f"is recomputed), M > 1 runs checkpoint='never' (recomputing is a memory trade, not "
        f"overhead). Machine load before: {before}; after: {common.load()}."
    )
    text = table(rows)
    print(text, notes, sep="\n\n")
    record(TITLE, text, notes=notes, path=common.results_path(args, "overhead"))
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=15)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=1, help="math threads (both sides)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = min(args.rounds, 3), 2
    return args


if __name__ == "__main__":
    raise SystemExit(main())
