"""Where a real model's pipe in one process loses to the two cores: its walk, and two at once.

Three contenders, alternating step by step in one run (``bench_models.py``'s job: transformers'
GPT-2 or Llama, 8 blocks x 256, 16 x 64 tokens, M=8, one math thread each, checkpoint off):

- ``plain``: the one-core job (the 8 micro-batches one after another on the plain model);
- ``one thread``: ``pipepar.wrap(model, split=..., devices=["cpu", "cpu"], schedule=...)``
  with every action run on the calling thread, one after another in an order that never waits
  (the pipe's own walk: hand-offs, driver threads, hooks, split backwards, no overlap);
- ``two workers``: the same pipe as users run it, a worker thread per stage.

``one thread / plain`` is what the walk costs over the model's own arithmetic, and
``plain / 2 / two workers`` the fraction of the two cores' ideal that the pipe reaches. A
second pass traces the same two pipes (``pipepar.tracing``) and sums each worker's
forward, backward and weight actions: the sum of the two workers over the sum on one thread is
what running the actions at once adds to them, and worker 0 over worker 1 the stages'
imbalance. The ``limit-threads`` row of ``bench_models.py`` says how much two copies of the
plain model lose on two threads of one process (1-3% here).

A second table splits the walk on one thread against the plain job: the plain micro-batches'
forwards and backwards (timed apart), the pipe's forward actions and its backward and weight
actions (traced), and what the pipe's step spends outside any action (splitting the batch,
setting up the run, joining the losses, handing gradients to ``.grad``).

A third table says what bounds the two workers' step: the schedule's critical path with each
action taking its traced time (:func:`schedule_bound`). With the one-thread times scaled to the
plain job's, it is what the layout and the schedule allow a pipe with no cost of its own; with
the one-thread times, what the walk allows; with the two workers' times, what running at once
allows. The rest of the measured step is waiting: hand-overs and wake-ups between workers.
``--chain`` adds GPT-2's modules laid out by hand as an ``nn.Sequential`` (the chain compute,
no cut) to every table, in the same run.

    python benchmarks/bench_walk.py --write                     # GPT-2 and Llama, zb-v and 1f1b
    python benchmarks/bench_walk.py --models gpt2 --schedules zb-v --rounds 6
    python benchmarks/bench_walk.py --chain --models gpt2       # and GPT-2 as an nn.Sequential
    python benchmarks/bench_walk.py --quick                     # seconds; CI smoke test
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks import bench_models as models
from benchmarks._results import markdown_table, record
from benchmarks.gap_analysis import per_worker
from pipepar.core.schedule import Schedule, timed
from pipepar.local import cpu_malloc

TITLE = "Real models in one process: the walk and the workers at once"
HEADERS = [
    "model", "schedule", "plain ms", "one thread ms (x plain)", "two workers ms (of ideal)",
    "compute on one thread: worker 0 + 1 ms", "compute at once: worker 0 + 1 ms",
    "at once / one thread",
]  # fmt: skip
WALKS = ("one thread", "two workers")
LETTERS = {"forward": "F", "backward": "B", "weight": "W"}
PARTS_TITLE = "Real models in one process: where the walk's time goes"
PARTS_HEADERS = [
    "model", "schedule", "plain forward ms", "walk forward ms (x)", "plain backward ms",
    "walk backward + weight ms (x)", "walk outside actions ms",
    "two workers: forward ms (x walk)", "two workers: backward + weight ms (x walk)",
]  # fmt: skip

BOUND_TITLE = "Real models in one process: what bounds the two workers' step"
BOUND_HEADERS = [
    "model", "schedule", "ideal ms (plain / 2)", "bound, plain costs ms (of ideal)",
    "bound, walk's costs ms (of ideal)", "bound, costs at once ms (of ideal)",
    "two workers ms (of ideal)",
]  # fmt: skip

BOUND_NOTE = (
    "Bounds: the schedule's critical path (its listed order; each worker starts its next action "
    "when what it waits for has ended, with no hand-over cost) with each action taking: its "
    "traced time on one thread scaled so the forwards and the backwards sum to the plain "
    "job's (plain costs: the layout and the schedule alone); its traced time on one thread "
    "(the walk's costs); its traced time with both workers running (costs at once)."
)


def _pipe(
    work: models.Job, schedule: str, *, one_thread: bool, chain: bool
) -> tuple[Any, common.Step]:
    """``(pipe, step)``: the model as it is (its forward cut while it runs) or, with ``chain``,
    GPT-2's modules laid out by hand as an ``nn.Sequential`` (``bench_models``' chain)."""
    library = "pipepar-chain" if chain else "pipepar"
    step, pipe = models.one_process(library, schedule, work, 8)
    if one_thread:  # every action on the caller's thread, as the pipe does with one worker
        pipe._view.workers = lambda backward=False: None
    return pipe, step


def _traced(pipe: Any, step: Callable[[], None]) -> Callable[[], dict[str, Any]]:
    """``step`` of ``pipe``, traced: each worker's forward, backward and weight actions in it,
    each action, the forward and the backward + weight actions of both, and the step, seconds."""

    def compute() -> dict[str, Any]:
        with pipepar.tracing(pipe) as tracer:
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        rows = per_worker(tracer.events, pipe.schedule.placement)
        actions: dict[tuple[int, str, int], float] = {}
        for e in tracer.events:
            if e.kind in LETTERS:
                key = (e.stage, LETTERS[e.kind], e.microbatch)
                actions[key] = actions.get(key, 0.0) + e.duration
        return {
            "workers": [r["forward"] + r["backward"] + r["weight"] for r in rows],
            "actions": actions,
            "forward": sum(r["forward"] for r in rows),
            "backward": sum(r["backward"] + r["weight"] for r in rows),
            "step": wall,
        }

    return compute


def schedule_bound(schedule: Schedule, actions: dict[tuple[int, str, int], float]) -> float:
    """The step, seconds, if every action of ``schedule`` took its time in ``actions`` (keyed
    ``(stage, "F" | "B" | "W", micro-batch)``; an absent one takes none) and each worker began
    its next listed action as soon as what it waits for had ended: no hand-over, no slowing of
    one worker by the other. A worker that runs another stage's W while waiting can beat it."""
    return max(
        timed(schedule, lambda a, split: actions.get((a.stage, a.kind, a.microbatch), 0.0)).values()
    )


def _scaled(
    actions: dict[tuple[int, str, int], float], forward: float, backward: float
) -> dict[tuple[int, str, int], float]:
    """``actions`` with the forwards scaled by ``forward`` and the B and W by ``backward``."""
    return {k: t * (forward if k[1] == "F" else backward) for k, t in actions.items()}


def _plain_parts(work: models.Job, m: int) -> Callable[[], dict[str, float]]:
    """The one-core job with its forwards and backwards timed apart, seconds per step."""
    model = copy.deepcopy(work.model)
    parts = work.ids.tensor_split(m)

    def step() -> dict[str, float]:
        forward = backward = 0.0
        for part in parts:
            start = time.perf_counter()
            loss = model(input_ids=part, labels=part).loss / m
            middle = time.perf_counter()
            loss.backward()
            forward, backward = forward + middle - start, backward + time.perf_counter() - middle
        model.zero_grad(set_to_none=True)
        return {"forward": forward, "backward": backward}

    return step


def measure(work: models.Job, schedule: str, rounds: int, *, chain: bool = False) -> dict[str, Any]:
    """Median step times of the three contenders (alternating, after a step each to warm up)
    and, from a traced pass alternating with the plain job timed in parts, the median compute
    per worker of the pipe on one thread and on its workers, and the forward, backward + weight
    and outside-action times against the plain job's forwards and backwards."""
    pipes = {k: _pipe(work, schedule, one_thread=k == "one thread", chain=chain) for k in WALKS}
    steps = {"plain": models.one_core(work, 8), **{k: step for k, (_, step) in pipes.items()}}
    for step in steps.values():
        step()
    times = common.alternate({k: common.timer(s, 1) for k, s in steps.items()}, rounds)
    traced: dict[str, Callable[[], dict[str, Any]]] = {
        k: _traced(pipe, step) for k, (pipe, step) in pipes.items()
    }
    traced["plain"] = _plain_parts(work, 8)
    for compute_step in traced.values():
        compute_step()
    compute = common.alternate(traced, max(2, rounds // 2))
    walk = compute.pop("one thread")
    plain_parts = {k: _median_ms(compute["plain"], k) for k in ("forward", "backward")}
    walk_parts = {k: _median_ms(walk, k) for k in ("forward", "backward")}
    alone = _median_actions(walk)
    at_plain = _scaled(
        alone,
        plain_parts["forward"] / walk_parts["forward"],
        plain_parts["backward"] / walk_parts["backward"],
    )
    at_once = _median_actions(compute["two workers"])
    sched = pipes["two workers"][0].schedule
    return {
        "model": work.name,
        "layout": "chain" if chain else "model",
        "schedule": schedule,
        **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
        **{
            f"{k}_compute_ms": [statistics.median(c["workers"][w] for c in v) * 1e3 for w in (0, 1)]
            for k, v in (("one thread", walk), ("two workers", compute["two workers"]))
        },
        "plain_parts_ms": plain_parts,
        "walk_parts_ms": {
            **walk_parts,
            "outside": statistics.median(c["step"] - c["forward"] - c["backward"] for c in walk)
            * 1e3,
        },
        "at_once_parts_ms": {
            k: _median_ms(compute["two workers"], k) for k in ("forward", "backward")
        },
        "bound_ms": {
            k: schedule_bound(sched, actions) * 1e3
            for k, actions in (("plain", at_plain), ("one thread", alone), ("at once", at_once))
        },
    }


def _median_actions(samples: list[dict[str, Any]]) -> dict[tuple[int, str, int], float]:
    """Each action's median time over the traced steps ``samples``, seconds."""
    keys = {k for s in samples for k in s["actions"]}
    return {k: statistics.median(s["actions"].get(k, 0.0) for s in samples) for k in keys}


def _median_ms(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples) * 1e3


def _name(r: dict[str, Any]) -> str:
    return models.MODELS[r["model"]] + (" as nn.Sequential" if r["layout"] == "chain" else "")


def row(r: dict[str, Any]) -> list[object]:
    plain, one, two = (r[f"{k}_ms"] for k in ("plain", "one thread", "two workers"))
    alone, together = r["one thread_compute_ms"], r["two workers_compute_ms"]
    return [
        _name(r), r["schedule"], f"{plain:.1f}", f"{one:.1f} ({one / plain:.2f})",
        f"{two:.1f} ({plain / 2 / two:.2f})",
        f"{alone[0]:.1f} + {alone[1]:.1f} = {sum(alone):.1f}",
        f"{together[0]:.1f} + {together[1]:.1f} = {sum(together):.1f}",
        f"{sum(together) / sum(alone):.2f}",
    ]  # fmt: skip


def parts_row(r: dict[str, Any]) -> list[object]:
    plain, walk, both = r["plain_parts_ms"], r["walk_parts_ms"], r["at_once_parts_ms"]
    return [
        _name(r), r["schedule"], f"{plain['forward']:.1f}",
        f"{walk['forward']:.1f} ({walk['forward'] / plain['forward']:.2f})",
        f"{plain['backward']:.1f}",
        f"{walk['backward']:.1f} ({walk['backward'] / plain['backward']:.2f})",
        f"{walk['outside']:.1f}",
        f"{both['forward']:.1f} ({both['forward'] / walk['forward']:.2f})",
        f"{both['backward']:.1f} ({both['backward'] / walk['backward']:.2f})",
    ]  # fmt: skip


def bound_row(r: dict[str, Any]) -> list[object]:
    ideal = r["plain_ms"] / 2
    cells = [r["bound_ms"][k] for k in ("plain", "one thread", "at once")] + [r["two workers_ms"]]
    return [
        _name(r), r["schedule"], f"{ideal:.1f}",
        *(f"{t:.1f} ({ideal / t:.2f})" for t in cells),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cpu_malloc.tune()
    torch.set_num_threads(1)
    before = common.load()
    results = []
    for name in args.models:
        work = models.job(name, quick=args.quick)
        for schedule in args.schedules:
            for chain in (False, True) if args.chain and name == "gpt2" else (False,):
                results.append(measure(work, schedule, args.rounds, chain=chain))
                print(markdown_table(HEADERS, [row(results[-1])]).splitlines()[-1], flush=True)
    table = markdown_table(HEADERS, [row(r) for r in results])
    parts = markdown_table(PARTS_HEADERS, [parts_row(r) for r in results])
    bounds = markdown_table(BOUND_HEADERS, [bound_row(r) for r in results])
    print(table)
    print(parts)
    print(bounds)
    notes = (
        f"Medians of {args.rounds} rounds (each: one step of every contender, the order "
        "rotating, after a warm-up step each); compute from "
        f"{max(2, args.rounds // 2)} traced steps of each pipe. "
        f"Load before: {before}; after: {common.load()}."
    )
    if args.write:
        record(TITLE, table, notes=notes, path=common.results_path(args, "walk"))
        record(PARTS_TITLE, parts, notes=notes, path=common.results_path(args, "walk"))
        record(
            BOUND_TITLE,
            bounds,
            notes=notes + " " + BOUND_NOTE,
            path=common.results_path(args, "walk"),
        )
    common.write_json(args.json, results)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=12)
    parser.add_argument("--models", type=models._listed, default=list(models.MODELS))
    parser.add_argument("--schedules", type=models._listed, default=["zb-v", "1f1b"])
    parser.add_argument(
        "--chain",
        action="store_true",
        help="also GPT-2's modules as an nn.Sequential (the chain compute), in the same run",
    )
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in models.MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(models.MODELS)}")
    if args.quick:
        args.rounds, args.schedules = 1, ["1f1b"]
    return args


if __name__ == "__main__":
    sys.exit(main())
