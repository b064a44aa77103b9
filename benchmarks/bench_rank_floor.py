"""What a rank of ``pipepar.distributed`` spends beyond a hand-written pipeline of the same model.

Two ranks (gloo, one core and one math thread each) run transformers' GPT-2 of
``bench_models.py`` split at its middle block, M=8, GPipe order, in the same two processes:

- **limit**: each rank runs the whole model's micro-batches one after another (the same run's
  limit of ``bench_models.py``);
- **hand-written**: the blocks called directly, the activation sent with ``dist.send`` and its
  gradient sent back, plain ``backward()``; no checks, no hooks, no threads. It computes what
  the model computes (its loss is checked against the model's own before timing);
- **pipepar.distributed**: ``ppd.wrap(model, split=[middle block], schedule=...)``, the model as
  transformers builds it (four equal stages, two per rank, for the virtual-stage schedules);
- with ``--pieces``, pipepar with one of its pieces switched off (analysis only; the results
  are then not checked): the route check's walk of each micro-batch's graph, and the direct
  weight-gradient terms (every weight gradient left to autograd).

Each rank's CPU seconds per step (``time.process_time``, all its threads) and the step's wall
time (a barrier before and after each step) are taken in alternating blocks, so the machine's
drift reaches every contender alike.

    python benchmarks/bench_rank_floor.py [--schedule gpipe] [--rounds 5] [--steps 6]
        [--pieces] [--write]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_models as bm
from benchmarks._common import load
from benchmarks._procs import spawn_pair
from benchmarks._results import markdown_table, record

LIMIT = "limit: one-core job x 2 processes"
HAND = "hand-written"
PIPE = "pipepar.distributed"
PIECES = {"route check off": "check", "direct terms off": "direct"}


def hand_written(work: bm.Job, m: int, rank: int) -> Callable[[], None]:
    """One GPipe step of the hand-written pipeline on ``rank`` (0: embeddings and the first
    half of the blocks; 1: the rest, the final norm, the tied head and the loss)."""
    halves = bm.gpt2_halves(work)
    parts = work.ids.tensor_split(m)
    width = work.model.transformer.wte.embedding_dim

    def first() -> None:
        outs = []
        for ids in parts:
            h = halves.front(ids)
            dist.send(h.detach(), 1)
            outs.append(h)
        for h in outs:
            grad = torch.empty_like(h)
            dist.recv(grad, 1)
            h.backward(grad)

    def last() -> None:
        kept = []
        for ids in parts:
            x = torch.empty(ids.shape[0], ids.shape[1], width)
            dist.recv(x, 0)
            x.requires_grad_(True)
            kept.append((x, halves.back(x, ids) / m))
        for x, loss in kept:
            loss.backward()
            assert x.grad is not None
            dist.send(x.grad, 0)

    def step() -> None:
        (first if rank == 0 else last)()
        halves.model.zero_grad(set_to_none=True)

    return step


def _switches() -> Callable[[str | None], None]:
    """``switch(piece)``: turn ``piece`` (a value of :data:`PIECES`) off, the others on;
    ``None``: all on. Analysis only: it swaps private functions of pipepar."""
    from pipepar.core import split_backward
    from pipepar.program import route

    walk = route.GraphCheck.walk
    direct, kernel = split_backward._direct_edges, split_backward._kernel_edges

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def switch(piece: str | None) -> None:
        route.GraphCheck.walk = nothing if piece == "check" else walk  # type: ignore[method-assign]
        split_backward._direct_edges = nothing if piece == "direct" else direct
        split_backward._kernel_edges = nothing if piece == "direct" else kernel

    return switch


def _rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import pipepar.distributed as ppd
        from pipepar.local import cpu_malloc

        cpu_malloc.tune()
        ppd.bind_cores(local_rank=rank, local_world_size=2)
        work = bm.job("gpt2", quick=args.quick)
        steps = {LIMIT: bm.one_core(work, args.chunks), HAND: hand_written(work, args.chunks, rank)}
        paths = bm.split(work, bm.stages(args.schedule))
        pipe = ppd.wrap(
            copy.deepcopy(work.model), split=paths, chunks=args.chunks, schedule=args.schedule,
            checkpoint="never",
        )  # fmt: skip
        steps[PIPE] = bm._stepped(pipe, work.ids)
        switch = _switches()
        names = [LIMIT, HAND, PIPE, *(PIECES if args.pieces else [])]
        cpu: dict[str, list[float]] = {n: [] for n in names}
        wall: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                switch(PIECES.get(name))
                step = steps.get(name, steps[PIPE])
                step()  # untimed: the first after a switch
                for _ in range(args.steps):
                    dist.barrier()
                    c, t = time.process_time(), time.perf_counter()
                    step()
                    cpu[name].append(time.process_time() - c)
                    dist.barrier()
                    wall[name].append(time.perf_counter() - t)
        switch(None)
        out[rank] = {"cpu": cpu, "wall": wall}
        pipe.close()
    finally:
        dist.destroy_process_group()


def table(result: dict[int, Any]) -> str:
    """Per contender: each rank's median CPU ms per step, their sum against the hand-written
    one's (the limit's halved: each of its ranks runs the whole model), the wall time per step
    (median, p10-p90) and the median rate against the limit's (a pipeline's step takes one
    batch, the limit's two)."""
    rows = []
    names = list(result[0]["cpu"])
    base = sum(statistics.median(result[r]["cpu"][HAND]) for r in (0, 1))
    limit = statistics.median(result[0]["wall"][LIMIT])
    for name in names:
        cpus = [statistics.median(result[r]["cpu"][name]) for r in (0, 1)]
        share = sum(cpus) / base / (2 if name == LIMIT else 1)
        walls = sorted(result[0]["wall"][name])
        p10, p90 = walls[len(walls) // 10], walls[(len(walls) * 9) // 10]
        median = statistics.median(walls)
        rate = 1.0 if name == LIMIT else limit / (2 * median)
        rows.append(
            [name, f"{cpus[0] * 1e3:.1f}", f"{cpus[1] * 1e3:.1f}", f"{share:.2f}x",
             f"{median * 1e3:.1f}", f"{p10 * 1e3:.1f}-{p90 * 1e3:.1f}", f"{rate:.2f}"]
        )  # fmt: skip
    return markdown_table(
        ["contender", "rank 0 CPU ms/step", "rank 1 CPU ms/step", "CPU vs hand-written",
         "wall ms/step median", "wall p10-p90", "of limit (median)"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", help="pipepar's schedule")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument("--pieces", action="store_true", help="also pipepar with pieces off")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one step: for CI")
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.chunks = 1, 1, 2
    before = load()
    result = spawn_pair(_rank, args)
    text = table(result)
    print(text)
    if args.write:
        record(
            f"A rank's cost beyond a hand-written pipeline ({args.schedule})",
            text,
            notes=(
                f"GPT-2 of bench_models.py, "
                f"split at its middle block, M={args.chunks}, {args.rounds} rounds x "
                f"{args.steps} timed steps per contender; CPU: median per rank; wall: rank "
                f"0's, a barrier before and after each step. Machine load before: {before}; "
                f"after: {load()}."
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
