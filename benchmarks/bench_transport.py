"""What a message between two ranks of one host costs: gloo's sockets or shared memory.

Across ranks (``pipepar.distributed``) the activations and gradients of neighbouring CPU ranks
on one host travel through shared memory (``pipepar/ranks/shared_memory.py``) unless
``PIPEPAR_SHARED_MEMORY=0`` keeps them on gloo. This script sends messages back and forth
between two spawned processes (each bound to a core of its own when there are two), after a
barrier, for each transport and message size, and reports per round trip:

- **wall**: the time of one round trip (median and p90 over the round trips);
- **CPU per message**: the process CPU time of both ranks (every thread: gloo's transport
  threads too) over the messages (two a round trip; a message's send and receive together):
  what the ranks' own work loses to the transport.

    python benchmarks/bench_transport.py --write
    python benchmarks/bench_transport.py --quick      # seconds; CI smoke test
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._procs import spawn_pair
from benchmarks._results import markdown_table, record
from pipepar.ranks.shared_memory import connect, supported

TITLE = "Messages between two ranks of one host: gloo or shared memory"
SIZES = {"4 KiB": 1024, "128 KiB (2 x 64 x 256)": 32768, "4 MiB": 1 << 20}  # float32 elements
TRANSPORTS = ("gloo", "shared memory")


def _round_trips(rank: int, channel: Any, elements: int, trips: int) -> tuple[list[float], float]:
    """``trips`` round trips of ``elements`` floats; their wall times and the CPU spent."""
    out, back = torch.ones(elements), torch.empty(elements)
    peer = 1 - rank
    walls = []
    dist.barrier()
    cpu = time.process_time()
    for _ in range(trips):
        start = time.perf_counter()
        if rank == 0:
            channel.send(out, peer).wait()
            channel.recv(back, peer).wait()
        else:
            channel.recv(back, peer).wait()
            channel.send(out, peer).wait()
        walls.append(time.perf_counter() - start)
    return walls, time.process_time() - cpu


class _Gloo:
    def send(self, t: torch.Tensor, peer: int) -> Any:
        return dist.isend(t, peer, tag=3)

    def recv(self, t: torch.Tensor, peer: int) -> Any:
        return dist.irecv(t, peer, tag=3)


class _Shared:
    def __init__(self, rank: int) -> None:
        shared = connect(dist.group.WORLD, rank, [0, 1])
        assert shared is not None, "shared memory is not available here"
        self.shared = shared

    def send(self, t: torch.Tensor, peer: int) -> Any:
        return self.shared.isend(t, peer, "fwd", 3)

    def recv(self, t: torch.Tensor, peer: int) -> Any:
        return self.shared.irecv(t, peer, "fwd", 3)


def _rank(rank: int, port: int, trips: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        channels = {"gloo": _Gloo(), "shared memory": _Shared(rank)}
        for name, channel in channels.items():
            for size, elements in SIZES.items():
                _round_trips(rank, channel, elements, max(2, trips // 10))  # warm up
                walls, cpu = _round_trips(rank, channel, elements, trips)
                out[f"{name}:{size}:{rank}"] = (walls, cpu)
    finally:
        dist.destroy_process_group()


def measure(trips: int) -> dict[str, Any]:
    """Per ``"transport:size:rank"``: the round trips' wall times and the rank's CPU time."""
    return spawn_pair(_rank, trips)


def table(got: dict[str, Any]) -> str:
    rows = []
    for name in TRANSPORTS:
        for size in SIZES:
            walls, cpu0 = got[f"{name}:{size}:0"]
            cpu1 = got[f"{name}:{size}:1"][1]
            ordered = sorted(walls)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            per_message = (cpu0 + cpu1) / (2 * len(walls))  # two messages a trip
            rows.append([name, size, len(walls), f"{1e6 * statistics.median(walls):.0f}",
                         f"{1e6 * p90:.0f}", f"{1e6 * per_message:.0f}"])  # fmt: skip
    headers = ["transport", "message", "round trips", "wall median, us", "wall p90, us",
               "CPU per message, us"]  # fmt: skip
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=400, help="round trips per case")
    parser.add_argument("--quick", action="store_true", help="a few round trips (smoke test)")
    parser.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    parser.add_argument("--results", help="markdown file to write to (default: RESULTS.md)")
    args = parser.parse_args(argv)
    if not supported():
        print("shared-memory messages need x86-64 Linux (or PIPEPAR_SHARED_MEMORY is 0)")
        return 1
    text = table(measure(5 if args.quick else args.trips))
    print(text)
    if args.write:
        notes = (
            "Two spawned processes, each bound to a core of its own, one math thread each; "
            "a round trip: rank 0 sends and waits, rank 1 receives and sends the same size "
            "back. CPU per message: both ranks' process CPU time (all threads) over the "
            "messages (two a round trip), each message's send and receive together."
        )
        kwargs = {"path": Path(args.results)} if args.results else {}
        record(TITLE, text, notes=notes, **kwargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
