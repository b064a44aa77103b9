"""Run a function on a few gloo ranks on localhost and collect what each returns."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def spawn(world: int, body: Callable[[int], Any], *, timeout: float = 300.0) -> dict[int, Any]:
    """``body(rank)`` on ``world`` fresh processes joined in a gloo group (one math thread
    each); its return value per rank. A rank's exception fails the caller with its traceback.

    ``body`` must be importable (a module-level function), as the processes are spawned.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, body, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    for r, value in got.items():
        assert not isinstance(value, _Failed), f"rank {r} failed:\n{value.text}"
    return got


class _Failed:
    """A rank's traceback (a class of its own: a body may well return a string)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _rank(rank: int, world: int, port: int, body: Callable[[int], Any], results: Any) -> None:
    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        results.put((rank, body(rank)))
    except BaseException:
        results.put((rank, _Failed(traceback.format_exc())))
    dist.destroy_process_group()
