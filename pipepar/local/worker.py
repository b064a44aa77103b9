"""Who runs the pipeline's actions: one worker thread per stage, or the calling thread.

A worker runs its stage's actions in the schedule's order and blocks on :class:`Slots` until an
input arrives from the neighbouring stage, so stages overlap as soon as data lets them. On the
CPU each worker sets its own number of math threads (an OpenMP setting local to the thread), so
two stages on two cores do not fight over both. ``torch.set_num_threads`` also records its value
as the count every thread started later begins with; a worker puts that default back, so the
caller's setting and that of its later threads stay what they were.

Where the CPU workers each compute with one math thread and there are as many of them as
cores the process may use, each worker is bound to a core of its own (Linux;
:func:`worker_cores`). A model's micro-batch drivers follow the worker that hands them their turn
onto its core (:mod:`pipepar.local.core_follow`); with the workers left to the operating
system, two of them woken on the same core would bring their drivers there too, and those,
bound, share that core while the other idles. ``PIPEPAR_PIN_WORKERS=0`` leaves the workers
unbound.

If an action raises, the pipeline is aborted: every worker waiting on a slot wakes up and stops,
all workers are joined, and the caller receives the first exception, annotated with the stage
and micro-batch it came from. No thread is left waiting for data that will never come.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch

from pipepar.core import switches
from pipepar.core.logs import debug_enabled

__all__ = [
    "IDLE",
    "Aborted",
    "Slots",
    "WorkerPool",
    "init_thread",
    "math_threads",
    "run_inline",
    "worker_cores",
]

_log = logging.getLogger(__name__)
_DEBUG = debug_enabled()


class Aborted(Exception):
    """Raised in a worker whose pipeline was aborted by a failure elsewhere."""


IDLE = object()
"""What :meth:`Slots.take` returns instead of waiting when the caller has other work."""


class Slots:
    """Hand-off points between stages: ``put(key, value)`` once, ``take(key)`` once.

    ``take`` blocks until the value is there. With ``blocking=False`` a missing value is a bug in
    the schedule and raises at once instead of hanging.

    A hand-off happens at every action, so it enters the condition's lock itself (a C call, not
    the condition's Python methods) and wakes the workers only while one waits (counted under
    the lock; with one thread running every action, never).
    """

    def __init__(self, *, blocking: bool = True) -> None:
        self._values: dict[Hashable, object] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads inside a wait on the condition
        self._aborted = False
        self._blocking = blocking

    def put(self, key: Hashable, value: object) -> None:
        """Deliver ``value`` under ``key`` and wake the worker waiting for it."""
        if _DEBUG:
            _log.debug("put %s", key)
        with self._lock:
            self._values[key] = value
            if self._waiting:
                self._cond.notify_all()

    def _wait(self, timeout: float | None = None) -> None:
        """Wait on the condition (the lock held), counted so that a hand-off wakes it."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def take(self, key: Hashable, idle: Callable[[], bool] | None = None) -> object:
        """Remove and return the value under ``key``, waiting for it if needed; if ``idle()``
        says there is other work while the value is missing, return :data:`IDLE` instead of
        waiting (checked again whenever a value arrives)."""
        with self._lock:
            while key not in self._values:
                if self._aborted:
                    raise Aborted
                if not self._blocking:
                    raise RuntimeError(f"pipepar schedule bug: {key} taken before it was put")
                if idle is not None and idle():
                    return IDLE
                self._wait()
            if _DEBUG:
                _log.debug("take %s", key)
            return self._values.pop(key)

    def wait_until(self, ready: Callable[[], bool], poll: float) -> None:
        """Return once ``ready()``; asked again on every hand-off and every ``poll`` seconds
        (for changes that come without one). Raises :class:`Aborted` if aborted meanwhile."""
        with self._lock:
            while not ready():
                if self._aborted:
                    raise Aborted
                self._wait(poll)

    def check(self) -> None:
        """Raise :class:`Aborted` if the pipeline was aborted."""
        if self._aborted:
            raise Aborted

    def abort(self) -> None:
        """Wake every waiting worker with :class:`Aborted` and drop the values held."""
        with self._lock:
            self._aborted = True
            self._values.clear()
            self._cond.notify_all()


# Held while a worker sets its count and puts the default back, so no other worker reads the
# default in between (it would take the first worker's count for the process default).
_DEFAULT_LOCK = threading.Lock()


def init_thread(threads: int, device: torch.device, core: int | None = None) -> None:
    """Set up a new pipepar thread: its math threads, its CUDA device, and its core."""
    with _DEFAULT_LOCK:
        default = torch.get_num_threads()  # a new thread starts at the process default
        torch.set_num_threads(threads)
        _set_default_threads(default)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if core is not None:  # an OSError: the core was taken from the process meanwhile
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, (core,))


@contextlib.contextmanager
def math_threads(n: int) -> Iterator[None]:
    """The calling thread computes with ``n`` math threads inside the block (the count of the
    workers whose actions it runs, so that each kernel splits its work, and rounds, as it does
    on them), then with its own count again."""
    own = torch.get_num_threads()
    if own == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(own)


def worker_cores(devices: Sequence[torch.device], threads: Sequence[int]) -> list[int | None]:
    """The core each worker is bound to (``None``: unbound), in the order of ``devices``.

    The CPU workers are bound, one to each core the calling thread may use in ascending order,
    when there are at least two of them, each computes with one math thread (``threads``) and
    they are exactly as many as those cores: the pipe then has the cores to itself, as a
    two-stage pipe with ``threads=1`` on two cores has. Otherwise (more math threads, whose
    OpenMP helpers inherit their creator's cores; spare cores the operating system may move a
    worker to; no ``os.sched_setaffinity``; ``PIPEPAR_PIN_WORKERS=0``) no worker is bound.
    """
    unbound: list[int | None] = [None] * len(devices)
    if not hasattr(os, "sched_getaffinity") or not switches.pin_workers():
        return unbound
    cpu = [j for j, d in enumerate(devices) if d.type == "cpu"]
    allowed = sorted(os.sched_getaffinity(0))
    if len(cpu) < 2 or len(cpu) != len(allowed) or any(threads[j] != 1 for j in cpu):
        return unbound
    for j, core in zip(cpu, allowed):
        unbound[j] = core
    return unbound


def _set_default_threads(n: int) -> None:
    """Make ``n`` the count of threads started from now on, leaving the calling thread's own.

    ``torch.set_num_threads`` sets both the calling thread's count and this default, and torch
    has no call for the default alone: a short-lived thread makes the call and takes the other
    effect with it.
    """
    helper = threading.Thread(target=torch.set_num_threads, args=(n,), name="pipepar-threads")
    helper.start()
    helper.join()


class WorkerPool:
    """One long-lived thread per stage; ``run(jobs, slots)`` runs ``jobs[j]`` on worker ``j``."""

    def __init__(self, devices: Sequence[torch.device], *, threads: Sequence[int]) -> None:
        cores = worker_cores(devices, threads)
        self._executors = [
            ThreadPoolExecutor(1, f"pipepar-stage{j}", init_thread, (n, d, c))
            for j, (d, n, c) in enumerate(zip(devices, threads, cores))
        ]
        self._finalizer = weakref.finalize(self, _shutdown, list(self._executors))

    def run(self, jobs: Sequence[Callable[[], None]], slots: Slots) -> None:
        """Run one job per stage concurrently; re-raise the first failure after all stopped."""
        futures = [ex.submit(job) for ex, job in zip(self._executors, jobs)]
        try:
            _wait_first_failure(futures)
        except BaseException:  # KeyboardInterrupt while waiting: stop the workers, then re-raise
            slots.abort()
            wait(futures)
            raise
        if any(f.exception() is not None for f in futures if f.done()):
            slots.abort()
            wait(futures)
            raise _first_failure(futures)

    def close(self) -> None:
        """Stop the threads (they end once their current job is done)."""
        self._finalizer()


def _wait_first_failure(futures: Sequence[Future[None]]) -> None:
    # Short timeouts keep the caller's thread responsive to KeyboardInterrupt.
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=0.05, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            return


def _first_failure(futures: Sequence[Future[None]]) -> BaseException:
    errors = [f.exception() for f in futures]
    real = [e for e in errors if e is not None and not isinstance(e, Aborted)]
    return real[0] if real else next(e for e in errors if e is not None)


def _shutdown(executors: list[ThreadPoolExecutor]) -> None:
    for ex in executors:
        ex.shutdown(wait=False, cancel_futures=True)


def run_inline(actions: Sequence[Callable[[], None]]) -> None:
    """Run actions one after another on the calling thread (one stage, or CUDA backward)."""
    for action in actions:
        action()
