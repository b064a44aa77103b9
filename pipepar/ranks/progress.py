"""Progress: what each rank of a pipeline runs and waits for, and a time limit on every wait.

A rank that waits for a peer that never comes (a rank that skipped a step, a data loader that
ran dry on one rank, a rank stuck in its own code) must neither wait forever nor end with a bare
socket error. Every wait of a pipe (a receive, a send, a collective) goes through
:meth:`Progress.wait`, which gives up after the pipe's ``timeout`` with a
:class:`~pipepar.ranks.failure.StallError` naming what it waited for; the pipe posts it
(:mod:`~pipepar.ranks.failure`) with what each other rank was doing, so every rank ends
with one report that says where the pipeline stopped.

Knowing what the other ranks do costs the step nothing measurable: the step only sets
attributes (the action it starts, what it waits for), a :class:`ProgressBoard` thread writes
the rank's line to the c10d store when it changed, ten times per timeout at most, and a report
reads the other ranks' lines only when it is made. It must not talk to peers itself: a rank that
waits cannot answer.

Under NCCL a wait only orders CUDA streams (the CPU does not block there), so no deadline is set
on it: the process groups' own timeout, the same seconds, ends a stall. The board's thread then
logs the rank's line and its peers' once the rank has stood still for most of the timeout,
before NCCL's watchdog ends the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor

from pipepar.core.executor import PHASES
from pipepar.core.schedule import Action
from pipepar.ranks.failure import CommError, Where, comm, wait

__all__ = ["Progress", "ProgressBoard", "describe"]

logger = logging.getLogger(__name__)

#: Looks per timeout: a stalled peer's line is at most timeout / _LOOKS old when a report reads
#: it, and a rank's progress costs one store write per timeout / _LOOKS at most.
_LOOKS = 10
#: Under NCCL, the share of the timeout a rank stands still before its line is logged.
_WATCH_SHARE = 0.8


def describe(action: Action, *, several: bool = False) -> str:
    """How reports name an action, e.g. ``"backward of micro-batch 2"`` (``several``: the
    rank runs several stages, so the stage is named too).

    Example:
        >>> describe(Action(1, "F", 3)), describe(Action(1, "W", 0), several=True)
        ('forward of micro-batch 3', 'weight gradients of micro-batch 0 of stage 1')
    """
    phase = PHASES[action.kind]
    where = f" of stage {action.stage}" if several else ""
    return f"{phase} of micro-batch {action.microbatch}{where}"


class Progress:
    """What this rank runs and waits for; every wait of its pipe goes through :meth:`wait`.

    The step sets :attr:`doing` (through :meth:`begin`); :meth:`wait` sets :attr:`waiting`
    while it blocks. Both are plain attributes: reading them is the board thread's business.

    Args:
        timeout: seconds a wait may take; ``None``: no limit of pipepar's (the process groups'
            own timeout still applies).
        bounded: whether a wait blocks the CPU, so that a deadline can end it (gloo); False
            under NCCL, whose waits only order streams.
    """

    def __init__(self, timeout: float | None = None, *, bounded: bool = True) -> None:
        self.timeout = timeout
        self.bounded = bounded
        self._within = timedelta(seconds=timeout) if timeout is not None and bounded else None
        self.steps = 0
        """Steps finished."""
        self.doing: str | None = None
        """What the rank runs now, e.g. ``"backward of micro-batch 2"``; ``None`` between steps."""
        self.done: str | None = None
        """What the rank ran before :attr:`doing`: its last finished action."""
        self.waiting: str | None = None
        """The transfer or collective the rank blocks in, if any."""
        self.posted: Callable[[], str | None] = lambda: None
        """The failure another rank posted, if any (set by the pipe's guard)."""

    # -- the step's side: attribute writes only ----------------------------------------------
    def begin(self, doing: str) -> None:
        """The rank starts ``doing`` (in a step); what it did before is finished."""
        self.done, self.doing = self.doing, doing

    def end_step(self) -> None:
        """The step is over (nothing changes outside a step)."""
        if self.doing is not None:
            self.done, self.doing = self.doing, None
            self.steps += 1

    def wait(self, work: dist.Work | None, what: str) -> None:
        """Wait for ``work`` at most ``timeout`` seconds (see :func:`~pipepar.ranks.failure.
        wait`); ``what`` names it in errors and in the rank's line meanwhile."""
        if work is None:
            return
        self.waiting = what
        wait(work, what, self._within)
        self.waiting = None

    def wait_watching(self, work: dist.Work | None, what: str) -> None:
        """:meth:`wait` for a collective started in the middle of a step, whose peers may fail
        before they reach it: the board is read meanwhile, so such a failure ends the wait at
        once instead of at the timeout."""
        if work is None:
            return
        deadline = time.monotonic() + (self._within.total_seconds() if self._within else 1e9)
        while not work.is_completed() and time.monotonic() < deadline:
            self.check_failures()
            time.sleep(0.01)
        self.wait(work, what)

    def check_failures(self) -> None:
        """Raise :class:`~pipepar.ranks.failure.CommError` if a rank posted a failure: a
        collective started after a peer left would only end at the timeout."""
        report = self.posted()
        if report is not None:
            raise CommError(f"another rank failed: {report}")

    def wait_all(self, pending: list[tuple[dist.Work | None, str]]) -> None:
        """:meth:`wait` for each ``(work, what)`` of ``pending`` in order, taking it off the
        list once done (the caller's frames never hold a work an error could keep alive)."""
        while pending:
            self.wait(*pending[0])
            pending.pop(0)

    def all_reduce(
        self,
        t: Tensor,
        group: dist.ProcessGroup | None,
        name: str,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> None:
        """Reduce ``t`` in place over ``group`` (a sum, or ``op``), waiting as :meth:`wait`
        does; ``name`` says what is reduced, e.g. ``"the gradient all-reduce"``."""
        what = f"{name} over ranks {dist.get_process_group_ranks(group or dist.group.WORLD)}"
        self.check_failures()
        with comm(what):
            work = dist.all_reduce(t, op=op, group=group, async_op=True)
        self.wait(work, what)

    # -- reading ------------------------------------------------------------------------------
    def state(self) -> tuple[int, str | None, str | None, str | None]:
        """What changes from action to action: (steps finished, doing, waiting, done)."""
        return self.steps, self.doing, self.waiting, self.done

    def line(self, here: Where) -> str:
        """This rank's progress in words, e.g. ``"rank 0 (stage 0, replica 0) is in step 2 at
        the forward of micro-batch 1, not blocked in a transfer, last finished the forward of
        micro-batch 0"``.

        Example:
            >>> p = Progress(3.0)
            >>> p.begin("forward of micro-batch 0"); p.waiting = "receiving x"
            >>> p.line(Where(1, 1, 0))
            'rank 1 (stage 1, replica 0) is in step 1 at the forward of micro-batch 0, blocked in receiving x'
        """  # noqa: E501
        steps, doing, waiting, done = self.state()
        if doing is None:
            if steps == 0:
                return f"{here} has not started a step"
            return f"{here} finished step {steps} and is outside pipe.step"
        blocked = f"blocked in {waiting}" if waiting else "not blocked in a transfer"
        after = f", last finished the {done}" if done else ""
        return f"{here} is in step {steps + 1} at the {doing}, {blocked}{after}"


class ProgressBoard:
    """This rank's line in the c10d store, kept current by a thread; the peers' read on demand.

    Nothing runs without a timeout (then no stall is reported either).

    Args:
        progress: this rank's progress.
        store: a store shared by every rank of the grid (the default process group's).
        prefix: unique per pipeline, the same on all of its ranks.
        here: this rank's place.
        peers: the global ranks whose lines a report gives (those this rank talks to).
    """

    def __init__(
        self,
        progress: Progress,
        store: dist.Store,
        prefix: str,
        here: Where,
        peers: Sequence[int],
    ) -> None:
        self.progress, self.here, self.peers = progress, here, list(peers)
        self._store = dist.PrefixStore(prefix + "progress/", store)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if progress.timeout is not None:
            self._thread = threading.Thread(
                target=self._publish, name="pipepar-progress", daemon=True
            )
            self._thread.start()

    def others(self) -> str:
        """What each peer last published, joined with ``"; "`` (``""`` when unknown).

        Example:
            >>> board.others()  # doctest: +SKIP
            'rank 0 (stage 0, replica 0) is in step 2 at the forward of micro-batch 1, ...'
        """
        if self._thread is None:
            return ""
        lines = []
        try:
            for rank in self.peers:
                key = str(rank)
                found = self._store.check([key])
                lines.append(_text(self._store.get(key)) if found else f"rank {rank}: no line yet")
        except Exception:  # the store is gone (its host ended): nothing to add
            logger.debug("could not read the progress of ranks %s", self.peers, exc_info=True)
            return ""
        return "; ".join(lines)

    def stop(self) -> None:
        """Stop the thread (it ends within one look; nothing waits for it)."""
        self._stop.set()

    def _publish(self) -> None:
        """The thread: write the rank's line whenever it changed; under NCCL, log a rank that
        stands still for most of the timeout."""
        timeout = self.progress.timeout or 0.0
        interval = timeout / _LOOKS
        last, since, told = None, time.monotonic(), False
        while True:
            state = self.progress.state()
            try:
                if state != last:
                    last, since, told = state, time.monotonic(), False
                    self._store.set(str(self.here.rank), self.progress.line(self.here))
                elif self._stands_still(state, since, timeout) and not told:
                    told = True
                    self._log(time.monotonic() - since, timeout)
            except Exception:  # the store is gone (the process group was destroyed): stop
                logger.debug("progress of %s no longer published", self.here, exc_info=True)
                return
            if self._stop.wait(interval):
                return

    def _stands_still(self, state: tuple[object, ...], since: float, timeout: float) -> bool:
        """Whether to log: waits are not bounded and the step has not moved for long."""
        in_step = state[1] is not None
        return (
            not self.progress.bounded
            and in_step
            and time.monotonic() - since > (_WATCH_SHARE * timeout)
        )

    def _log(self, still: float, timeout: float) -> None:
        others = self.others()
        logger.warning(
            "pipepar: %s, unchanged for %.1f s of its timeout=%g s (the process group's "
            "watchdog ends a stalled wait at the timeout)%s",
            self.progress.line(self.here),
            still,
            timeout,
            f"; {others}" if others else "",
        )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
