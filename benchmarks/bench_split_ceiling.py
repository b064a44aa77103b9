"""What a split allows: each stage's share of the work and the best rate each schedule can reach.

``bench_models.py`` splits transformers' GPT-2 and Llama at the middle block (two stages) or
at blocks 2, 4 and 6 (four, for the virtual-stage schedules). Blocks are equal, but the last
stage also holds the final norm, the head and the loss, so the stages are not. This script
times each stage's forward and backward of one micro-batch of that job on one thread (the
plain model, timestamps where each stage begins: a pre-hook on the unit that starts it, and a
gradient hook on the hidden state it is given), then plays every schedule on those times
(``pipepar.core.schedule.timed``: each action as long as its stage's measured F or B; a split
backward's B and W half of it each) and gives the step each schedule's shape allows on two
workers with no overhead, as a fraction of the limit that ``bench_models.py`` measures (the
one-core job on each of the two cores: half the job's work per worker).

    python benchmarks/bench_split_ceiling.py --write      # both models, RESULTS.md section
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_models as bm
from benchmarks._results import record
from pipepar.core import named_schedules
from pipepar.core import schedule as schedules

TITLE = "Real models: what the split allows (analysis)"
STAGES = {"gpipe": 2, "1f1b": 2, "zb-h1": 2, "interleaved-1f1b": 4, "zb-v": 4}


def stage_times(work: bm.Job, n: int, m: int, repeats: int) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of each of ``n`` stages on one micro-batch."""
    model = work.model
    modules = dict(model.named_modules())
    marks: dict[str, float] = {}
    hooks = []
    for k, path in enumerate(bm.split(work, n), start=1):

        def pre(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], k: int = k) -> None:
            marks[f"f{k}"] = time.perf_counter()
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden.register_hook(lambda g, k=k: marks.__setitem__(f"b{k}", time.perf_counter()))

        hooks.append(modules[path].register_forward_pre_hook(pre, with_kwargs=True))
    ids = work.ids[: work.batch // m]
    forward: list[list[float]] = [[] for _ in range(n)]
    backward: list[list[float]] = [[] for _ in range(n)]
    for r in range(repeats + 2):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        marks["f0"], marks[f"f{n}"] = start, time.perf_counter()
        marks[f"b{n}"] = time.perf_counter()
        loss.backward()
        marks["b0"] = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if r >= 2:  # two untimed rounds first
            for s in range(n):
                forward[s].append(marks[f"f{s + 1}"] - marks[f"f{s}"])
                backward[s].append(marks[f"b{s}"] - marks[f"b{s + 1}"])
    for h in hooks:
        h.remove()
    return [statistics.median(t) for t in forward], [statistics.median(t) for t in backward]


def ceiling(name: str, f: list[float], b: list[float], m: int) -> float:
    """The fraction of the limit schedule ``name`` reaches on two workers with these times."""
    sched = named_schedules.make(name, len(f), m, n_workers=2)

    def cost(a: schedules.Action, split: bool) -> float:
        if a.kind == "F":
            return f[a.stage]
        if split:  # B the input gradients, W the weights': half of the backward each
            return b[a.stage] / 2
        return b[a.stage] if a.kind == "B" else 0.0  # a W after a whole B does nothing

    step = max(schedules.timed(sched, cost).values())
    return m * (sum(f) + sum(b)) / 2 / step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama", help="comma list of: gpt2, llama")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument("--repeats", type=int, default=20, help="timed micro-batches")
    parser.add_argument("--quick", action="store_true", help="tiny models, few repeats")
    parser.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    parser.add_argument("--results", help="markdown file to write to (default: RESULTS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for name in args.models.split(","):
        work = bm.job(name, quick=args.quick)
        for n in sorted(set(STAGES.values())):
            if work.layers % n:
                continue
            f, b = stage_times(work, n, args.chunks, repeats)
            total = sum(f) + sum(b)
            shares = " / ".join(f"{(f[s] + b[s]) / total:.3f}" for s in range(n))
            fits = [s for s, k in STAGES.items() if k == n]
            best = ", ".join(f"{s} {ceiling(s, f, b, args.chunks):.2f}" for s in fits)
            ms = " / ".join(f"{1e3 * f[s]:.1f}+{1e3 * b[s]:.1f}" for s in range(n))
            rows.append(f"| {bm.MODELS[name]} | {n} | {ms} | {shares} | {best} |")
    table = [
        "| model | stages | F+B per stage, ms (one micro-batch, one thread) | share of the work "
        "| ceiling of each schedule (fraction of the limit) |",
        "|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(table))
    if args.write:
        notes = (
            f"M={args.chunks}, {repeats} timed micro-batches per model and split (medians); "
            "the job and splits of `bench_models.py`. A ceiling is what the schedule's shape "
            "leaves with these stage times and no overhead at all: a measured rate below it "
            "is the runtime's gap; a target above it is out of reach for this split."
        )
        kwargs = {"path": Path(args.results)} if args.results else {}
        record(TITLE, "\n".join(table), notes=notes, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
