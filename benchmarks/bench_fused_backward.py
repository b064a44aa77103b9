"""What folding a zero-bubble schedule's W into its B would give: host time, bits, timeline.

In the zero-bubble action lists a ``W`` often directly follows the ``B`` of the same stage and
micro-batch on one worker (ZB-H1's last stage, ZB-V's last, V-min's every stage). Where
nothing runs between them, the two could be one whole backward: one engine pass, no plan of
the split, no junction hooks, no W action. This script measures that without changing the
library: a schedule whose list drops each such ``W`` runs its ``B`` whole (a stage with no
``W`` listed for a micro-batch does not split it), which is exactly the fold.

Two folds: ``adjacent`` drops every ``W`` right after its own ``B``; ``kept`` only those whose
``B`` hands its input gradient to nobody or to a stage on the same worker (later in the same
list, so after the ``W`` anyway): that fold moves no action of the timeline. Each is
compared, in one process, with the listed schedule (steps alternating, 8 x Linear(64) +
ReLU, batch 64, M=16, two CPU workers, one math thread each): CPU seconds of the process per
step (``time.process_time``, less exposed to other jobs than wall time), wall seconds, the
engine passes per step, and whether the gradients are the listed schedule's bit for bit, at
4 rows per micro-batch and at 512 (where ``addmm_``, which a split's W sums with, and a
product added after it, which a whole backward makes, round differently); and the step on
unit costs (F, B, W one unit, a whole B two: :func:`pipepar.core.schedule.timed`), what the
fold does to the timeline where compute, not the host, decides.

    python benchmarks/bench_fused_backward.py --write
    python benchmarks/bench_fused_backward.py --quick      # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor, nn

import pipepar
from benchmarks import _common as common
from benchmarks._results import markdown_table, record
from pipepar.core import engine, named_schedules
from pipepar.core.schedule import Action, Schedule, timed, unit_costs

TITLE = "Host time per action: W folded into B"
SCHEDULES = ("zb-h1", "zb-v", "v-half", "v-min", "1f1b")
FOLDS = ("adjacent", "kept")


def fold(schedule: Schedule, how: str) -> Schedule:
    """``schedule`` without each ``W`` that directly follows its own ``B`` on one worker
    (``how="adjacent"``), or only those whose ``B`` hands its input gradient to no other
    worker (``how="kept"``: the timeline stays the listed one's)."""
    actions = []
    for w, work in enumerate(schedule.actions):
        kept: list[Action] = []
        for k, a in enumerate(work):
            if a.kind == "W" and k and _folds(schedule, w, work[k - 1], a, how):
                continue
            kept.append(a)
        actions.append(tuple(kept))
    return dataclasses.replace(schedule, name=f"{schedule.name}+{how}", actions=tuple(actions))


def _folds(schedule: Schedule, w: int, before: Action, a: Action, how: str) -> bool:
    if (before.kind, before.stage, before.microbatch) != ("B", a.stage, a.microbatch):
        return False
    return how == "adjacent" or a.stage == 0 or schedule.placement[a.stage - 1] == w


def model(width: int = 64, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def pipe_of(net: nn.Sequential, schedule: Schedule) -> nn.Module:
    n = schedule.n_stages
    return pipepar.wrap(
        copy.deepcopy(net),
        [len(net) // n] * n,
        devices=["cpu"] * schedule.n_workers,
        chunks=schedule.n_microbatches,
        schedule=schedule,
        checkpoint="never",
        threads=1,
    )


def listed(name: str, m: int) -> Schedule:
    stages = 4 if name in named_schedules.VIRTUAL else 2
    return named_schedules.make(name, stages, m, n_workers=2)


class Passes:
    """Engine passes (``pipepar.core.engine.grad`` calls) while counting."""

    def __init__(self) -> None:
        self.count, self._grad = 0, engine.grad

    def __enter__(self) -> Passes:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self._grad(*args, **kwargs)

        engine.grad = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        engine.grad = self._grad  # type: ignore[assignment]


def step(pipe: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    pipe.step(x, y, nn.functional.mse_loss)  # type: ignore[operator]
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    pipe.zero_grad(set_to_none=True)
    return grads


def same_bits(name: str, how: str, rows: int, m: int) -> bool:
    """Whether the fold's gradients are the listed schedule's bit for bit at ``rows`` rows
    per micro-batch."""
    net = model()
    x, y = torch.randn(rows * m, 64), torch.randn(rows * m, 64)
    base = listed(name, m)
    a, b = (step(pipe_of(net, s), x, y) for s in (base, fold(base, how)))
    return all(torch.equal(p, q) for p, q in zip(a, b))


def measure(name: str, how: str, m: int, steps: int) -> dict[str, Any]:
    """The listed schedule and its fold in one process, steps alternating."""
    net = model()
    x, y = torch.randn(4 * m, 64), torch.randn(4 * m, 64)
    base = listed(name, m)
    pipes = {"listed": pipe_of(net, base), how: pipe_of(net, fold(base, how))}
    passes: dict[str, int] = {}
    for key, pipe in pipes.items():
        step(pipe, x, y)
        with Passes() as counted:
            step(pipe, x, y)
        passes[key] = counted.count
    cpu: dict[str, list[float]] = {k: [] for k in pipes}
    wall: dict[str, list[float]] = {k: [] for k in pipes}
    order = list(pipes)
    for k in range(steps):
        for key in order if k % 2 == 0 else order[::-1]:
            c, w = time.process_time(), time.perf_counter()
            pipes[key].step(x, y, nn.functional.mse_loss)  # type: ignore[operator]
            cpu[key].append((time.process_time() - c) * 1e3)
            wall[key].append((time.perf_counter() - w) * 1e3)
            pipes[key].zero_grad(set_to_none=True)
    return {
        "schedule": name,
        "fold": how,
        "folded": sum(len(w) for w in base.actions) - sum(len(w) for w in fold(base, how).actions),
        "passes": (passes["listed"], passes[how]),
        "unit_step": (unit_step(base), unit_step(fold(base, how))),
        "cpu": (_q(cpu["listed"], 0), _q(cpu[how], 0)),
        "cpu_ratio": _ratios(cpu[how], cpu["listed"]),
        "wall_ratio": _ratios(wall[how], wall["listed"]),
    }


def unit_step(schedule: Schedule) -> float:
    """The step of ``schedule`` when F, B and W take one unit each and a whole B two (each
    over the stages per worker): what the fold does to the timeline where compute decides."""
    return max(timed(schedule, unit_costs(schedule.virtual)).values())


def _q(values: list[float], at: int) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[at]


def _ratios(new: list[float], old: list[float]) -> tuple[float, float, float]:
    r = [a / b for a, b in zip(new, old)]
    return (_q(r, 0), statistics.median(r), _q(r, 8))


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["schedule", "fold", "W folded", "engine passes per step, listed -> folded"]
    headers += ["step on unit costs, listed -> folded"]
    headers += ["CPU p10, listed -> folded", "CPU pair ratio p10 / median / p90"]
    headers += ["wall pair ratio p10 / median / p90", "bits equal, 4 rows", "bits equal, 512 rows"]
    lines = []
    for r in rows:
        lines.append(
            [
                r["schedule"],
                r["fold"],
                r["folded"],
                "{} -> {}".format(*r["passes"]),
                "{:g} -> {:g}".format(*r["unit_step"]),
                "{:.1f} -> {:.1f} ms".format(*r["cpu"]),
                "{:.2f} / {:.2f} / {:.2f}".format(*r["cpu_ratio"]),
                "{:.2f} / {:.2f} / {:.2f}".format(*r["wall_ratio"]),
                r["equal_small"],
                r["equal_large"],
            ]
        )
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    steps, m = (2, 4) if args.quick else (args.steps, args.chunks)
    large = 8 if args.quick else 512
    names = [n for n in args.schedules.split(",") if n]
    before = common.load()
    rows = []
    for name in names:
        for how in FOLDS:
            row = measure(name, how, m, steps)
            row["equal_small"] = same_bits(name, how, 4, m)
            row["equal_large"] = same_bits(name, how, large, m)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    notes = f"Machine load before: {before}; after: {common.load()}."
    common.write_json(args.json, rows)
    if args.write or args.quick:
        record(TITLE, text, notes=notes, path=common.results_path(args, "bench_fused_backward"))
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=1)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per pipe")
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches (M)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
