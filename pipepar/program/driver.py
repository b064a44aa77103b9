"""Run one micro-batch's forward code a stage at a time, when the schedule says so.

A model's ``forward`` is one Python call; a pipeline needs stage ``s`` of micro-batch ``i`` to
run as an action of its own, between other actions of stage ``s``'s worker. A :class:`Driver`
runs the call on a thread of its own and stops it at each stage boundary: a pre-forward hook on
every unit with parameters pauses the driver when the unit belongs to a later stage than the
one computing. The worker of stage ``s`` runs ``F(s, i)`` by calling :meth:`Driver.advance`,
which lets the driver go on through stage ``s`` and waits until it stops at the next boundary
(or the forward returns). So the code runs in the schedule's order, one stage of one
micro-batch at a time per worker, and the thread-local settings (grad mode, autocast, random
streams, the cut) are entered by the driver for each stage it runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipepar.local.core_follow import CoreFollower
from pipepar.local.worker import Aborted, init_thread

__all__ = [
    "Driver",
    "Finished",
    "Follower",
    "Weight",
    "active",
    "driver_pool",
    "unit_lock",
    "watch_units",
]

_local = threading.local()

Context = Callable[[int], contextlib.AbstractContextManager[Any]]
"""``context(stage)``: what the driver enters while it computes stage ``stage``."""

Weight = tuple[nn.Module, str, nn.Parameter]
"""A unit's parameter: the module registering it, its name there, the parameter."""


class Finished(BaseException):
    """Raised at a unit call when the rest of the forward is no business of this process
    (:meth:`Follower.done`): the driver's call ends there, quietly. A ``BaseException``, so
    that a model's own ``except Exception`` does not swallow it."""


class Follower(Protocol):
    """What a driver's unit hooks tell: the micro-batch's :class:`~pipepar.program.cut.Cut`."""

    def done(self) -> bool:
        """Whether nothing left of the forward concerns this process (the driver stops)."""
        ...

    def enter_unit(
        self, unit: int, weights: Sequence[Weight], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None: ...

    def leave_unit(self, output: Any) -> None: ...

    def stub(self) -> Callable[[], Any] | None:
        """What stands in for the output of the unit call just entered, if it is not run."""
        ...


def active() -> Driver | None:
    """The driver running on this thread, if any."""
    return getattr(_local, "driver", None)


class Driver:
    """The forward of one micro-batch: ``call()`` run on its own thread, stage by stage.

    Args:
        call: runs the model's forward for the micro-batch and returns its output.
        context: what to enter while computing a stage (entered again at each resumption).
    """

    def __init__(self, call: Callable[[], Any], context: Context) -> None:
        self._call, self._context = call, context
        self._cond = threading.Condition()
        self._allowed = -1  # the highest stage the driver may compute
        self._next = 0  # the stage the driver waits to compute (or computes)
        self._running = False
        self._done = False
        self._aborted = False
        self._error: BaseException | None = None
        self.result: Any = None
        self.stage = 0
        self._stack: contextlib.ExitStack | None = None
        self.follower: Follower | None = None  # told of every unit call
        self._core = CoreFollower()  # the driver's thread runs on its worker's core

    # -- the worker's side --------------------------------------------------------------------
    def advance(self, stage: int) -> None:
        """Let the forward compute ``stage`` and wait until it leaves it; re-raise its error."""
        with self._cond:
            if self._done or self._next > stage:
                self._raise()
                return  # no unit of ``stage`` runs in this micro-batch
            self._core.follow()
            self._allowed = stage
            self._running = True
            self._cond.notify_all()
            while self._running:
                self._cond.wait()
            self._raise()

    def prepare(self, stage: int) -> None:
        """Let the forward run on, without waiting for it, through the stages before
        ``stage`` (others', followed in shadow), so that the :meth:`advance` into ``stage``
        finds it there."""
        with self._cond:
            if self._done or self._running or self._allowed >= stage - 1:
                return
            self._core.follow()
            self._allowed = stage - 1
            self._running = True
            self._cond.notify_all()

    def abort(self) -> None:
        """Stop a driver waiting at a boundary (its forward raises :class:`Aborted`)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- the driver thread --------------------------------------------------------------------
    def run(self) -> None:
        """The driver thread's body."""
        _local.driver = self
        self._core.started()
        try:
            self._wait_for(0)
            self._enter(0)
            out = self._call()
            self.result = out
            self._leave()
        except BaseException as error:  # handed to the worker that waits, re-raised there
            self._close()
            with self._cond:
                if not isinstance(error, (Aborted, Finished)):
                    self._error = error
            self._finish()
            return
        finally:
            _local.driver = None
            # The call and context close over the mini-batch that holds this driver: dropped
            # now, the mini-batch's graphs go with its last reference instead of waiting for
            # the cycle collector (a step's activations, kept a step or more).
            self._call = self._context = _spent
        self._finish()

    def boundary(self, stage: int) -> None:
        """Called (on the driver thread) before a unit of ``stage`` runs."""
        if stage <= self.stage:
            return
        self._leave()
        with self._cond:
            if self._allowed < stage:  # else the worker let it run on through this stage
                self._next = stage
                self._running = False
                self._cond.notify_all()
        self._wait_for(stage)
        self._enter(stage)

    def _wait_for(self, stage: int) -> None:
        with self._cond:
            while self._allowed < stage and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise Aborted

    def _enter(self, stage: int) -> None:
        self.stage = stage
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._context(stage))

    def _leave(self) -> None:
        """Close the last stage's context (a failure there is the forward's failure)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _close(self) -> None:
        with contextlib.suppress(BaseException):  # already failing: report the first error
            self._leave()

    def _finish(self) -> None:
        with self._cond:
            self._done = True
            self._running = False
            self._next = 1 << 30
            self._cond.notify_all()


def _spent(*args: Any) -> Any:
    raise RuntimeError("pipepar: this micro-batch's forward has already run")


def watch_units(units: Sequence[Any], stage_of_unit: Sequence[int]) -> list[RemovableHandle]:
    """Hooks on every unit, for calls made by a driver (others are untouched): a unit with
    parameters is a place where the driver stops for its stage's turn; then the driver's
    follower is told of the call (it may change the arguments) and of its end (even a failed
    one).

    A unit runs one call at a time (:func:`unit_lock`, held from the follower's turn to the
    call's end): a unit the model calls again in a later stage computes there with stand-ins
    for its weights swapped into the module, which a call of an earlier stage running at the
    same moment on another thread must not see."""
    handles = []
    for k, (u, s) in enumerate(zip(units, stage_of_unit)):
        weights = [
            (module, name, p)
            for module in u.module.modules()
            for name, p in module._parameters.items()
            if p is not None
        ]
        lock = unit_lock(u.module)
        leave = _leaving(lock)
        pre = _entering(k, s if u.has_parameters else None, weights, lock, leave)
        handles.append(u.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(u.module.register_forward_hook(leave, always_call=True))
    return handles


def unit_lock(module: nn.Module) -> threading.RLock:
    """The lock a unit's calls made by the pipe hold (one per module)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.RLock()
        return lock


_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _entering(
    unit: int,
    stage: int | None,
    weights: list[Weight],
    lock: threading.RLock,
    leave: Callable[..., None],
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        driver = active()
        if driver is None:
            return None
        if stage is not None:
            driver.boundary(stage)
        follower = driver.follower
        if follower is None:
            return None
        if follower.done():
            raise Finished
        lock.acquire()
        _held().append(lock)  # released by the forward hook, which runs even if forward raises
        try:
            return follower.enter_unit(unit, weights, args, kwargs)
        except BaseException:
            # Left here: torch skips the always-called hooks on an error while any thread
            # compiles (torch.compiler.is_compiling() is one flag for every thread).
            leave(module, args, None)
            raise

    return hook


def _leaving(lock: threading.RLock) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        driver = active()
        if driver is None or driver.follower is None:
            return
        held = _held()
        entered = bool(held) and held[-1] is lock  # not if it failed waiting for its turn
        try:
            if entered:
                driver.follower.leave_unit(output)
        finally:
            if entered:
                held.pop()
                lock.release()

    return hook


def _held() -> list[threading.RLock]:
    """The unit locks this thread holds, innermost last."""
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = []
    return held


def driver_pool(
    pool: ThreadPoolExecutor | None, m: int, threads: int, device: torch.device
) -> ThreadPoolExecutor:
    """A thread for each of ``m`` drivers (all are alive at once, each waiting at its
    boundaries): ``pool`` if it has enough, else a new one (the old one is shut down)."""
    if pool is not None and pool._max_workers >= m:  # type: ignore[attr-defined]
        return pool
    if pool is not None:
        pool.shutdown(wait=False)
    return ThreadPoolExecutor(m, "pipepar-microbatch", init_thread, (threads, device))
