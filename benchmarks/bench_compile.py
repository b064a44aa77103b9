"""torch.compile through the pipe: a compiled pipe against the compiled plain model.

transformers' GPT-2 on the CPU. Contenders, each a training step (forward and backward, no
optimizer) of the same batch: the plain model with its blocks compiled (``block.compile()``,
the whole batch at once), the plain model eager, the pipe of the eager model and the pipe with
``compile=`` (two CPU stages, one math thread each, ``chunks=4``), in one process and across
two ranks (``pipepar.distributed.wrap``, gloo, one rank per stage; ``--no-ranks`` leaves
them out).
Each contender runs two warm-up steps first (the pipe's first call learns the cut eagerly, its
second compiles). The ratios say what compiling gains inside the pipe and what the pipe gains
over the compiled model on one core.

    python benchmarks/bench_compile.py [--quick] [--rounds 5] [--steps 4] [--backend inductor]
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
import pipepar.distributed as ppd
from benchmarks._common import alternate, load, timer
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record
from models import transformers_zoo as zoo

SCHEDULES = ("gpipe", "1f1b")


def _sizes(quick: bool) -> tuple[int, int, int, int, int]:
    """layers, hidden, heads, batch, tokens."""
    return (2, 32, 2, 4, 16) if quick else (8, 256, 4, 16, 64)


def _model(quick: bool) -> nn.Module:
    layers, hidden, heads, _, seq = _sizes(quick)
    torch.manual_seed(0)
    return zoo.gpt2(layers=layers, hidden=hidden, heads=heads, vocab=2048, positions=seq)


def _batch(quick: bool) -> torch.Tensor:
    _, _, _, batch, seq = _sizes(quick)
    return torch.randint(2048, (batch, seq), generator=torch.Generator().manual_seed(1))


def _plain(
    model: nn.Module, ids: torch.Tensor, compiled: dict[str, str] | None
) -> Callable[[], None]:
    if compiled is not None:
        for block in model.transformer.h:
            block.compile(**compiled)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _pipe(
    model: nn.Module, ids: torch.Tensor, schedule: str, compiled: dict[str, str] | None
) -> Callable[[], None]:
    layers = len(model.transformer.h)
    pipe = pipepar.wrap(
        model, split=[f"transformer.h.{layers // 2}"], devices=["cpu", "cpu"], chunks=4,
        schedule=schedule, threads=1, compile=compiled,
    )  # fmt: skip

    def step() -> None:
        pipe.step(input_ids=ids, labels=ids)
        pipe.zero_grad(set_to_none=True)

    return step


def rank_builder(
    spec: dict[str, Any], rank: int, world: int
) -> Callable[[str, int], Callable[[], None]]:
    """On each spawned rank: ``build(contender, m)`` makes the step of ``"ranks eager
    SCHEDULE"`` or ``"ranks compiled SCHEDULE"`` (one stage per rank)."""
    quick, options = spec["quick"], spec["options"]

    def build(contender: str, m: int) -> Callable[[], None]:
        kind, schedule = contender.rsplit(" ", 1)
        model, ids = _model(quick), _batch(quick)
        layers = len(model.transformer.h)
        pipe = ppd.wrap(
            model, split=[f"transformer.h.{layers // 2}"], chunks=m, schedule=schedule,
            compile=options if kind == "ranks compiled" else None,
        )  # fmt: skip

        def step() -> None:
            pipe.step(input_ids=ids, labels=ids)
            pipe.zero_grad(set_to_none=True)

        step()  # the cut learned; the group's warm-up step compiles
        return step

    return build


def _ranks(group: ProcessGroup, schedule: str, steps: int) -> dict[str, Callable[[], float]]:
    """The ranks' contenders: seconds per step, timed on the ranks between two barriers."""

    def timed(contender: str) -> Callable[[], float]:
        def run() -> float:
            answer = group.time(f"{contender} {schedule}", 4, steps)
            if isinstance(answer, str):
                raise RuntimeError(f"{contender} ({schedule}): {answer}")
            return answer

        return run

    contenders = {c: timed(c) for c in ("ranks eager", "ranks compiled")}
    for run in contenders.values():
        run()  # built and warmed up (the first steps compile)
    return contenders


def _contenders(
    quick: bool, schedule: str, options: dict[str, str], steps: int
) -> dict[str, Callable[[], float]]:
    model, ids = _model(quick), _batch(quick)
    made = {
        "plain eager": _plain(copy.deepcopy(model), ids, None),
        "plain compiled": _plain(copy.deepcopy(model), ids, options),
        "pipe eager": _pipe(copy.deepcopy(model), ids, schedule, None),
        "pipe compiled": _pipe(copy.deepcopy(model), ids, schedule, options),
    }
    for step in made.values():  # warm-up: the cut learned, then compiled
        step()
        step()
    return {name: timer(step, steps) for name, step in made.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps timed per round")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    parser.add_argument("--no-ranks", action="store_true", help="one process only")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the plain model runs here on one core; pipe workers set theirs
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    rounds = 1 if args.quick else args.rounds
    steps = 1 if args.quick else args.steps
    options = {"backend": "eager" if args.quick else args.backend}
    rows = []
    group = None
    if not args.no_ranks:
        spec = {"quick": args.quick, "options": options}
        group = ProcessGroup(2, "benchmarks.bench_compile:rank_builder", spec)
    try:
        for schedule in SCHEDULES:
            contenders = _contenders(args.quick, schedule, options, steps)
            if group is not None:
                contenders |= _ranks(group, schedule, steps)
            rows.append(_row(schedule, alternate(contenders, rounds)))
    finally:
        if group is not None:
            group.close()
    header = ["schedule", "plain eager ms", "plain compiled ms", "pipe eager ms",
              "pipe compiled ms"]  # fmt: skip
    header += ["ranks eager ms", "ranks compiled ms"] if not args.no_ranks else []
    header += ["compiled / eager pipe speed-up", "pipe compiled vs plain compiled (speed-up)"]
    if not args.no_ranks:
        header += ["compiled / eager ranks speed-up", "ranks compiled vs plain compiled"]
    table = markdown_table(header, rows)
    print(table)
    if args.write and not args.quick:
        layers, hidden, heads, batch, seq = _sizes(False)
        record(
            "torch.compile through the pipe",
            table,
            notes=f"transformers GPT-2 {layers} x {hidden}, {heads} heads, vocab 2048, "
            f"{batch} x {seq} tokens; backend {args.backend}; pipe: 2 CPU stages, one math "
            f"thread each, M=4; ranks: 2 gloo ranks, one stage and one math thread each, M=4, "
            f"seconds per step between two barriers; plain: one thread; {rounds} alternating "
            f"rounds of {args.steps} steps, medians; {load()}.",
        )
    return 0


def _row(schedule: str, times: dict[str, list[float]]) -> list[str]:
    """A schedule's medians (ms) and speed-ups."""
    med = {name: statistics.median(v) for name, v in times.items()}
    ratios = [
        med["pipe eager"] / med["pipe compiled"],
        med["plain compiled"] / med["pipe compiled"],
    ]
    if "ranks compiled" in med:
        ratios += [
            med["ranks eager"] / med["ranks compiled"],
            med["plain compiled"] / med["ranks compiled"],
        ]
    return [schedule, *(f"{med[n] * 1e3:.0f}" for n in med), *(f"{r:.2f}" for r in ratios)]


if __name__ == "__main__":
    sys.exit(main())
