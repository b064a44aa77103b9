"""What a message between two ranks costs the receiver: posted after it came, or before.

Across ranks (``pipepar.distributed``) each rank waits for the activations and gradients of the
other stages. On gloo a receive posted after its message was sent is matched by a round trip
between the two ranks' transport threads, which must each get a core; posted before, the
message lands in it as it arrives. This script measures the receiver's wait for one message
(``--values`` tensors of 2 x 64 x 256 floats and two of 1 x 64 positions: a transformer
block's inputs), on two spawned gloo processes:

- **late**: the sender sends, the receiver posts its receive 5 ms later (the message has come)
  and waits for it: what a rank pays when it asks for a value at the moment it needs it;
- **early**: the receive is posted before the message is sent (5 ms later; the receiver
  waits from 10 ms on): what pipepar does for the gradient of a value it sent
  (``Link.expect``), posted when the value leaves;
- **late, one message each**: ``late`` with every value in a message of its own (three), as a
  rank received a unit call's values before they travelled in one message (``Link.recv_many``).

Each case runs with both ranks idle and with both ranks busy (a thread of each multiplying
matrices, as in a pipeline: the cores are taken); every trial starts after a barrier. The table
gives the median and 90th-percentile wait over the trials.

    python benchmarks/bench_messages.py --write
    python benchmarks/bench_messages.py --quick      # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._procs import spawn_pair
from benchmarks._results import markdown_table, record

TITLE = "Messages between ranks: a receive posted after its message came, or before (gloo)"
CASES = ("late", "early", "late, one message each")
SHAPES = [((2, 64, 256), torch.float32), ((1, 64), torch.int64), ((1, 64), torch.int64)]


def _values() -> list[torch.Tensor]:
    return [torch.ones(shape, dtype=dtype) for shape, dtype in SHAPES]


def _packed(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).view(torch.uint8) for v in values])


def _trial(rank: int, case: str) -> float:
    """One message (or one per value) from rank 0 to rank 1; rank 1's wait in seconds."""
    values = _values()
    messages = values if case == "late, one message each" else [_packed(values)]
    dist.barrier()
    if rank == 0:
        if case == "early":
            time.sleep(0.005)  # the receive is posted by now
        works = [dist.isend(m, 1) for m in messages]
        for work in works:
            work.wait()
        return 0.0
    buffers = [torch.empty_like(m) for m in messages]
    if case == "early":
        works = [dist.irecv(b, 0) for b in buffers]
        time.sleep(0.010)  # the message has come (sent after 5 ms)
        start = time.perf_counter()
    else:
        time.sleep(0.005)  # the message has come
        start = time.perf_counter()
        works = [dist.irecv(b, 0) for b in buffers]
    for work in works:
        work.wait()
    return time.perf_counter() - start


def _busy(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = a @ a
        a = a / a.norm()


def _rank(rank: int, port: int, trials: int, out: dict[str, list[float]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        for load in ("idle", "busy"):
            stop = threading.Event()
            if load == "busy":
                threading.Thread(target=_busy, args=(stop,), daemon=True).start()
            for case in CASES:
                waits = [_trial(rank, case) for _ in range(trials)]
                if rank == 1:
                    out[f"{load}:{case}"] = waits
            stop.set()
    finally:
        dist.destroy_process_group()


def measure(trials: int) -> dict[str, list[float]]:
    """Rank 1's waits, per ``"load:case"``."""
    return spawn_pair(_rank, trials)


def table(waits: dict[str, list[float]]) -> str:
    rows = []
    for key, values in waits.items():
        load, _, case = key.partition(":")
        ordered = sorted(values)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        rows.append([case, load, len(values), f"{1e3 * statistics.median(values):.3f}",
                     f"{1e3 * p90:.3f}"])  # fmt: skip
    headers = ["receive", "ranks", "trials", "wait median, ms", "wait p90, ms"]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="messages per case")
    parser.add_argument("--quick", action="store_true", help="a few trials (smoke test)")
    parser.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    parser.add_argument("--results", help="markdown file to write to (default: RESULTS.md)")
    args = parser.parse_args(argv)
    text = table(measure(3 if args.quick else args.trials))
    print(text)
    if args.write:
        notes = (
            "Values: 2 x 64 x 256 float32 and two 1 x 64 int64 (132 KB), one message of their "
            "bytes unless each has its own. Busy: a thread of each rank multiplies 256 x 256 "
            "matrices all along. Each trial starts after a barrier; late: the sender sends at "
            "once, the receiver posts after 5 ms; early: the receiver posts at once, the sender "
            "sends after 5 ms, the receiver waits from 10 ms on."
        )
        kwargs = {"path": Path(args.results)} if args.results else {}
        record(TITLE, text, notes=notes, **kwargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
