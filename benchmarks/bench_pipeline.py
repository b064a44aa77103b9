"""Single-process pipeline efficiency and overhead: pipepar.wrap against torchgpipe.GPipe.

Efficiency: throughput of K stages with M micro-batches as a fraction of the bubble-limited ideal
K * M / (M + K - 1) x (one core running the same M micro-batches one after another, forward and
backward). Both libraries run with their defaults: pipepar gives each CPU stage an equal share
of the math threads (one each for two stages on two cores); torchgpipe's stage threads use
torch's default thread count. Contenders alternate within every
round; the table gives medians over rounds and the spread.

Overhead: ``wrap(model, [L], chunks=1)`` against the plain model on the same batch.

    python benchmarks/bench_pipeline.py            # K=2, M=8 headline + overhead
    python benchmarks/bench_pipeline.py --grid     # K in {1, 2}, M in {1, 2, 4, 8, 16}
    python benchmarks/bench_pipeline.py --quick --results /tmp/r.md   # seconds, for CI
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import pipepar
from benchmarks._results import RESULTS, markdown_table, record

Step = Callable[[], None]


def _train_step(module: nn.Module, x: torch.Tensor) -> Step:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    return step


def _sequential_step(module: nn.Module, x: torch.Tensor, m: int) -> Step:
    """One device running the same m micro-batches one after another (gradient accumulation)."""

    def step() -> None:
        module.zero_grad(set_to_none=True)
        for part in x.tensor_split(m):
            module(part).sum().backward()

    return step


def _time(step: Step, repeats: int, threads: int) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - start) / repeats
    finally:
        torch.set_num_threads(previous)


def _contenders(
    model: nn.Sequential, x: torch.Tensor, k: int, m: int
) -> dict[str, tuple[Step, int]]:
    """name -> (step, math threads of the calling thread)."""
    n = len(model)
    balance = [n // k + (1 if j < n % k else 0) for j in range(k)]
    wrap = {"devices": ["cpu"] * k, "chunks": m, "checkpoint": "never"}
    ours = pipepar.wrap(copy.deepcopy(model), balance, **wrap)
    steps = {
        "one core, same micro-batches": (_sequential_step(copy.deepcopy(model), x, m), 1),
        "pipepar.wrap": (_train_step(ours, x), k),
    }
    try:
        import torchgpipe

        theirs = torchgpipe.GPipe(
            copy.deepcopy(model), balance, devices=["cpu"] * k, chunks=m, checkpoint="never"
        )
        steps["torchgpipe.GPipe"] = (_train_step(theirs, x), k)
    except ImportError:  # pragma: no cover - torchgpipe is in the dev extra
        pass
    return steps


def efficiency(
    model: nn.Sequential, x: torch.Tensor, k: int, m: int, rounds: int, repeats: int
) -> list[list[object]]:
    """Rows: contender, median step ms, fraction of ideal (median, min-max)."""
    steps = _contenders(model, x, k, m)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, threads) in steps.items():
            times[name].append(_time(step, repeats, threads))
    base = times["one core, same micro-batches"]
    rows = []
    for name, samples in times.items():
        ideal = [b * (m + k - 1) / (k * m) for b in base]  # ideal step time per round
        fractions = [i / s for i, s in zip(ideal, samples)]
        rows.append(
            [
                f"K={k} M={m}",
                name,
                f"{1e3 * statistics.median(samples):.1f}",
                "-" if name.startswith("one core") else _spread(fractions, "{:.2f}", "-"),
            ]
        )
    return rows


def _spread(values: list[float], fmt: str, sep: str) -> str:
    """``median (min<sep>max)`` of values, each formatted with ``fmt``."""
    lo, mid, hi = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({lo}{sep}{hi})"


def overhead(
    model: nn.Sequential, x: torch.Tensor, rounds: int, repeats: int
) -> list[list[object]]:
    """Rows: plain model vs wrap(model, [L], chunks=1), same batch, default threads."""
    plain = copy.deepcopy(model)
    wrapped = pipepar.wrap(copy.deepcopy(model), [len(model)], devices=["cpu"], chunks=1)
    threads = torch.get_num_threads()
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(_train_step(plain, x), repeats, threads))
        b.append(_time(_train_step(wrapped, x), repeats, threads))
    ratios = [y / z - 1 for y, z in zip(b, a)]
    return [
        [
            f"{1e3 * statistics.median(a):.1f}",
            f"{1e3 * statistics.median(b):.1f}",
            _spread([100 * r for r in ratios], "{:+.1f}%", ".."),
        ]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", action="store_true", help="K in {1,2} x M in {1,2,4,8,16}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round (CI)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    width, batch = (64, 16) if args.quick else (1024, 256)
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    torch.manual_seed(0)
    model, x = models.mlp(depth=8, width=width), torch.randn(batch, width)
    configs = [(k, m) for k in (1, 2) for m in (1, 2, 4, 8, 16)] if args.grid else [(2, 8)]
    rows = [r for k, m in configs for r in efficiency(model, x, k, m, rounds, repeats)]
    table = markdown_table(["config", "contender", "step ms", "fraction of ideal (min-max)"], rows)
    over = markdown_table(
        ["plain ms", "wrap([L], chunks=1) ms", "overhead (min..max)"],
        overhead(model, x, rounds, repeats),
    )
    print(table, over, sep="\n\n")
    notes = (
        f"Model 8 x (Linear({width}, {width}) + ReLU), batch {batch}, checkpoint='never'; "
        f"{rounds} rounds x {repeats} steps, contenders alternating; ideal = "
        "K*M/(M+K-1) x one core on the same micro-batches. Every step includes "
        "zero_grad(set_to_none=True).\n\nOverhead (plain model vs one-stage pipe, default threads):"
        f"\n\n{over}"
    )
    title = "Single-process pipeline efficiency" + (" (grid)" if args.grid else "")
    record(title, table, notes=notes, path=args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
