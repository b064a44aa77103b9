"""A group of spawned processes, one per pipeline stage, that time steps on command.

The benchmark's main process keeps its in-process contenders and one :class:`ProcessGroup`
per multi-process library, and asks each in turn to time a few steps, so that all contenders
alternate within one run. Each rank runs one math thread, joins a gloo group on a free
localhost port, and builds its contenders lazily through a *factory*: a ``"module:function"``
name called as ``factory(spec, rank, world)`` that returns ``build(contender, m) -> step``.

With ``bind_cores``, each rank binds its threads to its share of the cores first
(:func:`pipepar.distributed.bind_cores`; rank ``r`` of ``world``, every rank on this host).

A rank times ``steps`` calls of ``step`` between two barriers; rank 0's seconds per step come
back. :meth:`ProcessGroup.step_times` instead starts every step together on all ranks (a
barrier before each) and returns each step's seconds, the slowest rank's
(:meth:`ProcessGroup.step_costs`: with the CPU seconds all ranks spent in it);
:meth:`ProcessGroup.peaks` runs one step on every rank and returns each rank's largest rise in
allocated CPU bytes during it, less what the step's ``static_bytes`` attribute names (what the
step allocates whatever the schedule, such as the gradients it makes anew). The rise is read
from the C allocator's bytes in use (glibc's ``mallinfo2``), sampled by a thread every 0.2 ms,
since ``torch.profiler`` sees only the allocations of the thread that started it and a rank
of a model cut while it runs computes its forwards on threads of its own. An error while
building or stepping comes back as its text instead of a time, and a group that stops
answering is terminated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipepar.distributed as ppd

Step = Callable[[], None]
Builder = Callable[[str, int], Step]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_pair(rank: Callable[..., None], *args: Any) -> dict[str, Any]:
    """``rank(r, port, *args, out)`` on two spawned processes (``port``: free, for their
    process group); what they put into the shared dict ``out``."""
    out = mp.Manager().dict()
    mp.spawn(rank, args=(free_port(), *args, out), nprocs=2)
    return dict(out)


def library_groups(
    libraries: Iterable[str], start: Callable[[], ProcessGroup], *, shared: bool = False
) -> dict[str, ProcessGroup]:
    """A :class:`ProcessGroup` per library, each started by ``start()``; with ``shared`` (the
    ``--quick`` smoke runs) one group serves every library, whose factory builds them all, so
    that a smoke run starts one group's processes instead of one group's per library."""
    libraries = list(libraries)
    if shared and libraries:
        return dict.fromkeys(libraries, start())
    return {library: start() for library in libraries}


def close_groups(groups: dict[str, ProcessGroup]) -> None:
    """Close each group of :func:`library_groups` once."""
    for group in {id(g): g for g in groups.values()}.values():
        group.close()


class ProcessGroup:
    """``world`` spawned ranks serving ``time(contender, m, steps)`` requests."""

    def __init__(
        self,
        world: int,
        factory: str,
        spec: dict[str, Any],
        *,
        timeout: float = 300,
        bind_cores: bool = False,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self._inbox = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    world,
                    port,
                    factory,
                    spec,
                    bind_cores,
                    self._inbox[rank],
                    self._outbox,
                ),
                daemon=True,
            )
            for rank in range(world)
        ]
        for p in self._procs:
            p.start()
        ready = self._gather()  # every rank says it is ready, or why not
        self.error: str | None = next((a for a in ready if isinstance(a, str)), None)
        if self.error is not None:
            self.close()

    def time(self, contender: str, m: int, steps: int) -> float | str:
        """Seconds per step of ``contender`` with ``m`` micro-batches, or an error's text."""
        answers = self._ask("time", contender, m, steps)
        return answers if isinstance(answers, str) else float(answers[0])

    def step_times(self, contender: str, m: int, steps: int, warmup: int = 0) -> list[float] | str:
        """Seconds of each of ``steps`` steps (after ``warmup`` untimed ones), the slowest
        rank's, every step started by a barrier on all ranks; or an error's text."""
        answers = self.step_costs(contender, m, steps, warmup)
        return answers if isinstance(answers, str) else [wall for wall, _ in answers]

    def step_costs(
        self, contender: str, m: int, steps: int, warmup: int = 0
    ) -> list[tuple[float, float]] | str:
        """As :meth:`step_times`, each step as ``(seconds, CPU seconds)``: the slowest rank's
        wall time and the CPU time all threads of all ranks spent in it, summed; or an error's
        text."""
        answers = self._ask("steps", contender, m, steps, warmup)
        if isinstance(answers, str):
            return answers
        return [(max(w for w, _ in ts), sum(c for _, c in ts)) for ts in zip(*answers)]

    def peaks(self, contender: str, m: int) -> list[int] | str:
        """Each rank's largest rise in allocated CPU bytes during one step of ``contender``
        (after its warm-up), less the step's ``static_bytes``; or an error's text."""
        answers = self._ask("peak", contender, m)
        return answers if isinstance(answers, str) else [int(a) for a in answers]

    def _ask(self, *request: Any) -> list[Any] | str:
        """Every rank's answer to ``request``, in rank order; or the text of the group's error,
        or of the first rank's that failed."""
        if self.error is not None:
            return self.error
        if not self.alive:
            return "error: the process group died earlier"
        for box in self._inbox:
            box.put(request)
        answers = self._gather()
        errors = [a for a in answers if isinstance(a, str)]
        return errors[0] if errors else answers

    @property
    def alive(self) -> bool:
        """Whether every rank is still running."""
        return all(p.is_alive() for p in self._procs)

    def _gather(self) -> list[Any]:
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(answers) < self.world:
            try:
                rank, answer = self._outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                return [f"error: no answer within {self.timeout:.0f} s"]
            answers[rank] = answer
        return [answers[r] for r in range(self.world)]

    def close(self) -> None:
        """Ask the ranks to stop, and terminate those that do not within a few seconds."""
        for box in self._inbox:
            box.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(
    rank: int,
    world: int,
    port: int,
    factory: str,
    spec: dict[str, Any],
    bind: bool,
    inbox: Any,
    outbox: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        if bind:
            ppd.bind_cores(rank, world)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        module, name = factory.split(":")
        build: Builder = getattr(importlib.import_module(module), name)(spec, rank, world)
    except Exception:
        outbox.put((rank, "error: " + traceback.format_exc(limit=3)))
        return
    outbox.put((rank, 0.0))
    steps: dict[tuple[str, int], Step] = {}
    while (request := inbox.get()) is not None:
        kind, contender, m, *counts = request
        try:
            if (contender, m) not in steps:
                steps[(contender, m)] = build(contender, m)
                _timed(steps[(contender, m)], 1)  # warm-up
            step = steps[(contender, m)]
            answer: float | list[tuple[float, float]] | int
            if kind == "peak":
                answer = _peak(step)
            elif kind == "steps":
                answer = _each(step, *counts)
            else:
                answer = _timed(step, *counts)
            outbox.put((rank, answer))
        except Exception as error:
            outbox.put((rank, f"error: {type(error).__name__}: {str(error)[:200]}"))
    dist.destroy_process_group()


def _timed(step: Step, n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / n


def _peak(step: Step) -> int:
    """The largest rise in allocated CPU bytes during one step, less its ``static_bytes``."""
    gc.collect()
    dist.barrier()
    with MallocPeak() as peak:
        step()
    dist.barrier()
    return peak.rise - int(getattr(step, "static_bytes", 0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


class MallocPeak:
    """The highest rise of the C allocator's bytes in use (every thread's) inside the block,
    sampled every ``every`` seconds: a plateau of held activations is seen, a spike shorter
    than a sample may not be."""

    def __init__(self, every: float = 2e-4) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self._info = libc.mallinfo2
        self._info.restype = _MallInfo2
        self.every, self.rise = every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def in_use(self) -> int:
        info = self._info()
        return int(info.uordblks + info.hblkhd)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.rise = max(self.rise, self.in_use() - self._start)
            time.sleep(self.every)

    def __enter__(self) -> MallocPeak:
        self._start = self.in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rise = max(self.rise, self.in_use() - self._start)


def _each(step: Step, n: int, warmup: int) -> list[tuple[float, float]]:
    """``warmup`` untimed steps, then the seconds and this process's CPU seconds (all its
    threads) of each of ``n``, all ranks starting each step together (so a step's time on the
    slowest rank is the pipeline's); the barriers' own CPU is outside the step's."""
    times = []
    for i in range(warmup + n):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - start, time.process_time() - cpu))
    dist.barrier()
    return times
