"""Two-rank pipeline throughput on CPU: pipepar.distributed vs torch.distributed.pipelining.

Setup (issue 4): 2 processes with one math thread each (gloo), 8 x (Linear(1024, 1024) + ReLU),
batch 256, M=8 micro-batches, balance [8, 8] layers. The reference is one process with one
thread running the same 8 micro-batches one after another (forward + backward); the ideal
2-stage pipeline runs K*M/(M+K-1) = 16/9 times as fast.

The machine is shared, and a 2-rank pipeline on 2 cores slows down as soon as anything else
runs. So the variants run in short interleaved rounds, each block of steps is tagged with the
CPU time other processes took meanwhile (from /proc/stat minus our own processes), and the table
reports the fraction of ideal over quiet blocks as well as over all blocks.

    python benchmarks/bench_distributed.py            # full run, writes benchmarks/RESULTS.md
    python benchmarks/bench_distributed.py --quick    # tiny smoke run for CI (no RESULTS.md)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar.distributed as ppd
from benchmarks._contenders import torch_pipelining
from benchmarks._procs import free_port
from benchmarks._results import markdown_table, record

BASELINE = "one core, same micro-batches"
VARIANTS = ("pipepar gpipe", "pipepar 1f1b", "torch.pipelining gpipe", "torch.pipelining 1f1b")
TITLE = "Distributed pipeline, 2 ranks x 1 thread (CPU, gloo)"
#: A block is "quiet" when other processes used less than this many cores meanwhile.
QUIET_CORES = 0.15


@dataclass
class Block:
    """Timed steps of one variant in one round, and the load other processes put meanwhile."""

    name: str
    times: list[float]
    others: float  # cores used by other processes, averaged over the block

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def build_model(width: int, blocks: int) -> nn.Sequential:
    """``blocks`` x (Linear(width, width) + ReLU), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())])


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    return x, torch.randn(args.batch, args.width, generator=g)


def _baseline(args: argparse.Namespace, rank: int) -> Callable[[], None]:
    """Rank 0 runs the whole model on the micro-batches one after another; rank 1 idles."""
    model = build_model(args.width, args.blocks)
    xs, ys = (t.tensor_split(args.chunks) for t in _batch(args))

    def step() -> None:
        for x, y in zip(xs, ys, strict=True):
            (nn.functional.mse_loss(model(x), y) / len(xs)).backward()

    return step if rank == 0 else lambda: None


def _pipepar(args: argparse.Namespace, rank: int, schedule: str) -> Callable[[], None]:
    model = build_model(args.width, args.blocks)
    half = len(model) // 2
    pipe = ppd.wrap(model, [half, half], chunks=args.chunks, schedule=schedule, checkpoint="never")
    x, y = _batch(args)

    def step() -> None:
        pipe.step(x, y, nn.functional.mse_loss)

    return step


def _torch(args: argparse.Namespace, rank: int, schedule: str) -> Callable[[], None]:
    model = build_model(args.width, args.blocks)
    half = len(model) // 2
    part = nn.Sequential(*list(model)[rank * half : (rank + 1) * half])
    run = torch_pipelining(part, rank, 2, args.chunks, schedule, nn.functional.mse_loss)
    x, y = _batch(args)
    return lambda: run(x, y)


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, from /proc/stat (0 where unavailable)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _block(name: str, step: Callable[[], None], args: argparse.Namespace) -> Block:
    """Warm up, then time ``args.steps`` steps, each started together on both ranks."""
    for _ in range(args.warmup):
        dist.barrier()
        step()
    dist.barrier()
    busy, wall, own = _busy_seconds(), time.perf_counter(), time.process_time()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    ours = torch.tensor([time.process_time() - own])
    wall = time.perf_counter() - wall
    dist.barrier()
    dist.all_reduce(ours)  # both ranks' CPU time, gloo threads included
    others = max(0.0, _busy_seconds() - busy - ours.item()) / wall
    return Block(name, times, others)


def _worker(rank: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    steps = {
        BASELINE: _baseline(args, rank),
        "pipepar gpipe": _pipepar(args, rank, "gpipe"),
        "pipepar 1f1b": _pipepar(args, rank, "1f1b"),
        "torch.pipelining gpipe": _torch(args, rank, "gpipe"),
        "torch.pipelining 1f1b": _torch(args, rank, "1f1b"),
    }
    rounds: list[list[Block]] = []
    while _agreed(rank == 0 and _more(rounds, args)):  # rank 0's timings decide for both
        rounds.append([_block(name, step, args) for name, step in steps.items()])
    if rank == 0:
        queue.put(rounds)
    dist.barrier()
    dist.destroy_process_group()


def _agreed(flag: bool) -> bool:
    """Rank 0's ``flag``, on every rank."""
    value = torch.tensor([int(flag)])
    dist.broadcast(value, 0)
    return bool(value.item())


def _more(rounds: list[list[Block]], args: argparse.Namespace) -> bool:
    """Another round? At least --repeats, then until every variant has --quiet quiet rounds."""
    if len(rounds) < args.repeats:
        return True
    if len(rounds) >= args.max_rounds:
        return False
    quiet = _fractions(rounds, args.chunks, quiet=True)
    return min(len(f) for f in quiet.values()) < args.quiet


def _fractions(rounds: list[list[Block]], m: int, *, quiet: bool) -> dict[str, list[float]]:
    """Per round: (one core's median step x (M+1)/(2M)) / the variant's median step."""
    out: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for blocks in rounds:
        base, *variants = blocks
        for b in variants:
            if not quiet or max(b.others, base.others) < QUIET_CORES:
                out[b.name].append(base.median * (m + 1) / (2 * m) / b.median)
    return out


def _table(rounds: list[list[Block]], args: argparse.Namespace) -> str:
    quiet, every = (_fractions(rounds, args.chunks, quiet=q) for q in (True, False))
    rows: list[list[object]] = []
    for k, name in enumerate((BASELINE, *VARIANTS)):
        calm = [t for blocks in rounds if blocks[k].others < QUIET_CORES for t in blocks[k].times]
        every_step = [t for blocks in rounds for t in blocks[k].times]
        step = statistics.median(calm or every_step)
        cells = [name, f"{step * 1e3:.1f}", f"{args.batch / step:.0f}"]
        if name == BASELINE:
            rows.append([*cells, "-", "-"])
            continue
        q, a = quiet[name], every[name]
        q_text = f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f}, n={len(q)})" if q else "-"
        rows.append([*cells, q_text, f"{statistics.median(a):.2f} (n={len(a)})"])
    headers = [
        "variant",
        "step ms (quiet median)",
        "samples/s (quiet)",
        "fraction of ideal, quiet rounds (range, n)",
        "fraction, all rounds",
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark, print the table, record it unless --quick; return quiet medians."""
    args = _parse(argv)
    load_before = os.getloadavg()[0]
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(free_port(), args, queue), nprocs=2, join=True)
    rounds: list[list[Block]] = queue.get()
    if args.verbose:
        for blocks in rounds:
            print(
                " | ".join(f"{b.name} {b.median * 1e3:.0f}ms others={b.others:.2f}" for b in blocks)
            )
    others = [b.others for blocks in rounds for b in blocks]
    table = _table(rounds, args)
    notes = (
        f"{args.blocks} x (Linear({args.width}, {args.width}) + ReLU), batch {args.batch}, "
        f"M={args.chunks}, balance [{args.blocks}, {args.blocks}] layers, checkpoint='never', "
        f"one math thread per process. {len(rounds)} interleaved rounds; per round and "
        f"variant {args.warmup} warm-up + {args.steps} timed steps. Fraction of ideal = (one "
        f"core's median step x (M+1)/(2M)) / the variant's median step, per round. A round "
        f"counts as quiet for a variant when other processes used < {QUIET_CORES} cores during "
        f"both its block and the baseline's. Load from other processes: median "
        f"{statistics.median(others):.2f} cores, max {max(others):.2f} (of {os.cpu_count()}); "
        f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}."
    )
    print(table)
    print(notes)
    if args.record:
        record(TITLE, table, notes=notes)
    quiet = _fractions(rounds, args.chunks, quiet=True)
    return {name: statistics.median(f) for name, f in quiet.items() if f}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, no RESULTS.md (CI smoke)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant per round")
    p.add_argument("--repeats", type=int, default=12, help="fewest interleaved rounds")
    p.add_argument("--quiet", type=int, default=8, help="go on until each variant has this many")
    p.add_argument("--max-rounds", type=int, default=60, help="stop here even if still noisy")
    p.add_argument("--verbose", action="store_true", help="print every block")
    p.add_argument("--no-record", dest="record", action="store_false", help="skip RESULTS.md")
    args = p.parse_args(argv)
    args.width, args.blocks, args.batch, args.chunks = 1024, 8, 256, 8
    if args.quick:
        args.width, args.blocks, args.batch = 64, 2, 32
        args.steps, args.warmup, args.repeats, args.record = 2, 1, 2, False
        args.quiet, args.max_rounds = 0, 2
    return args


if __name__ == "__main__":
    main()
