"""What running a model as it is costs: transformers' GPT-2 through ``pipepar.wrap``.

A pipe of any model runs the model's own forward on a thread per micro-batch and passes every
torch operation through a torch-function mode that cuts it into stages. This measures what that
costs and how well two stages overlap, against the same micro-batches run one after another on
one thread (gradient accumulation: the one-core unit):

* ``overhead``: a one-stage pipe (``balance=[all units]``, one worker) over the one-core run;
* ``of ideal``: the one-core time over two workers, against a two-stage pipe (one math thread
  per stage, stages planned by ``wrap(..., sample=batch)``), for the program route (GPT-2 as
  transformers builds it) and, for reference, for pipepar's own ``nn.Sequential`` GPT of the
  same sizes (``models.gpt``).

Contenders alternate in rotating rounds; medians, with the min-max spread over rounds.

    python benchmarks/bench_models.py [--quick] [--rounds 5] [--steps 3] [--write]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import pipepar
from benchmarks._common import Stats, alternate, load, timer
from benchmarks._results import markdown_table, record
from models import transformers_zoo as zoo

CHUNKS = 8


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return dict(layers=2, hidden=32, heads=2, vocab=64, seq=16, batch=16)
    return dict(layers=8, hidden=256, heads=4, vocab=2048, seq=64, batch=32)


def _tokens(size: dict[str, int]) -> Tensor:
    return torch.randint(
        size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0)
    )


def _gpt2(size: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.gpt2(
        layers=size["layers"], hidden=size["hidden"], heads=size["heads"], vocab=size["vocab"],
        positions=size["seq"],
    )  # fmt: skip


def _one_core(size: dict[str, int]) -> Callable[[], None]:
    model, ids = _gpt2(size), _tokens(size)

    def step() -> None:
        for part in ids.tensor_split(CHUNKS):
            (model(input_ids=part, labels=part).loss / CHUNKS).backward()
        model.zero_grad(set_to_none=True)

    return step


def _program_pipe(size: dict[str, int], stages: int, schedule: str) -> Callable[[], None]:
    model, ids = _gpt2(size), _tokens(size)
    n = len(pipepar.units(model))
    # Two stages: planned from a profile of the batch (times included), as a user would.
    balance = [n] if stages == 1 else None
    pipe = pipepar.wrap(
        model, balance, devices=["cpu"] * stages, chunks=CHUNKS, schedule=schedule, threads=1,
        sample=dict(input_ids=ids, labels=ids),
    )  # fmt: skip

    def step() -> None:
        pipe.step(input_ids=ids, labels=ids)
        model.zero_grad(set_to_none=True)

    return step


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _sequential_one_core(size: dict[str, int]) -> Callable[[], None]:
    model, ids = _sequential_gpt(size), _tokens(size)

    def step() -> None:
        for part in ids.tensor_split(CHUNKS):
            (_loss(model(part), part) / CHUNKS).backward()
        model.zero_grad(set_to_none=True)

    return step


def _sequential_gpt(size: dict[str, int]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return models.gpt(size["layers"], size["hidden"], size["heads"], size["vocab"], size["seq"])


def _sequential_pipe(size: dict[str, int], schedule: str) -> Callable[[], None]:
    model, ids = _sequential_gpt(size), _tokens(size)
    pipe = pipepar.wrap(
        model, devices=["cpu", "cpu"], chunks=CHUNKS, schedule=schedule, checkpoint="never",
        threads=1, sample=ids,
    )  # fmt: skip

    def step() -> None:
        pipe.step(ids, ids, _loss)
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per round")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the one-core references run here; pipe workers set their own
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    size = _sizes(args.quick)
    rounds, steps = (2, 1) if args.quick else (args.rounds, args.steps)
    builders = {
        "one core": lambda: _one_core(size),
        "pipe, 1 stage": lambda: _program_pipe(size, 1, "gpipe"),
        "pipe, 2 stages": lambda: _program_pipe(size, 2, args.schedule),
        "Sequential one core": lambda: _sequential_one_core(size),
        "Sequential pipe, 2 stages": lambda: _sequential_pipe(size, args.schedule),
    }
    contenders = {}
    for name, build in builders.items():
        step = build()
        step()  # warm-up
        contenders[name] = timer(step, steps)
    times = alternate(contenders, rounds)
    stats = {name: Stats.of(values) for name, values in times.items()}
    med = {name: s.median for name, s in stats.items()}
    rows = [[name, f"{s.median * 1e3:.0f}", f"{s.spread():.0%}"] for name, s in stats.items()]
    table = markdown_table(["contender", "ms/step (median)", "spread"], rows)
    overhead = med["pipe, 1 stage"] / med["one core"] - 1
    program = med["one core"] / (2 * med["pipe, 2 stages"])
    sequential = med["Sequential one core"] / (2 * med["Sequential pipe, 2 stages"])
    summary = (
        f"one-stage pipe over the one-core run: {overhead:+.1%}; two stages ({args.schedule}): "
        f"{program:.2f} of ideal for transformers' GPT-2, {sequential:.2f} for the "
        "nn.Sequential GPT of the same sizes"
    )
    print(table)
    print(summary)
    if args.write and not args.quick:
        record(
            "Real models as they are: what the cut costs",
            table + "\n\n" + summary + ".",
            notes=f"GPT-2 {size['layers']} layers x {size['hidden']}, vocab {size['vocab']}, "
            f"{size['batch']} x {size['seq']} tokens, M={CHUNKS}, one math thread per worker; "
            f"{rounds} alternating rounds of {steps} steps; {load()}.",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
