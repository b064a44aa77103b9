"""Fault reporting: one rank's error ends every rank of the pipeline grid with that error.

A rank that raises posts "rank r (stage j, replica d) failed in the backward of micro-batch i:
Error: message" to the c10d store (a rank that runs several stages: "rank r (stages j and k,
replica d) failed in the backward of micro-batch i of stage k: ..."), then closes its pipeline
process groups. Peers blocked on a receive or a collective with that rank see the connection
close (or, at the latest, their group timeout expire), read the store and raise
:class:`PipelineError` naming the failing rank, stage and micro-batch; they close their own
groups in turn, so the failure spreads along the grid within a bounded time instead of hanging.

A ``KeyboardInterrupt`` or ``SystemExit`` (a SIGTERM handler's, say) is posted and spreads the
same way, but the interrupted rank gets its own exception back, so Ctrl-C still stops it. A
rank that dies without a word (SIGKILL, default SIGTERM, a crash) closes its connections with
the process; its peers see "Connection closed by peer" from that rank and report it.

A rank that waits longer than the pipe's ``timeout`` for a peer that neither answers nor fails
(it skipped a step, or is stuck in its own code) raises :class:`StallError` naming what it
waited for; its report adds what the other ranks were doing
(:mod:`~pipepar.ranks.progress`) and spreads like any other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

__all__ = [
    "CommError",
    "FailureBoard",
    "PipelineError",
    "StallError",
    "Where",
    "comm",
    "guarded",
    "release_works",
    "wait",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a peer that saw a communication error waits for a report to appear. The failing
#: rank posts before it closes its connections, so the report is normally there already.
_REPORT_GRACE_S = 0.25
_KEY = "failure"
_SILENT_PEER = "no rank reported an error: a peer process died, was killed or is stuck"
_STALL_FIX = (
    "every rank of the pipeline must call the same steps: a rank that skipped one, or spends "
    "longer than the timeout on its own work (e.g. its data loader), stalls its peers; pass a "
    "larger timeout to ppd.wrap if it is only slow, or timeout=None for no limit"
)
#: How backends say that a wait ran out of time (gloo, the c10d work, NCCL).
_TIMED_OUT = ("timed out", "timeout", "timing out")
#: Frames whose locals may hold communication works (see release_works).
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
_COMM_DIRS = (
    *(os.path.join(_PACKAGE, sub) + os.sep for sub in ("ranks", "distributed", "program")),
    os.path.dirname(dist.__file__),
)
"""Where the frames that hold communication works live: the pipes across ranks (both routes),
what they share, and torch.distributed."""


@dataclass(frozen=True)
class Where:
    """A rank's place in the pipeline grid, used to name it in error messages."""

    rank: int
    """Global rank."""
    stage: int
    """Position of the rank in its pipeline (its stage, when it runs one)."""
    replica: int
    """Data-parallel replica index."""
    stages: tuple[int, ...] = ()
    """The stages the rank runs when there are several (virtual-stage schedules)."""

    def __str__(self) -> str:
        if len(self.stages) > 1:
            shown = ", ".join(map(str, self.stages[:-1])) + f" and {self.stages[-1]}"
            return f"rank {self.rank} (stages {shown}, replica {self.replica})"
        return f"rank {self.rank} (stage {self.stage}, replica {self.replica})"


class PipelineError(RuntimeError):
    """A rank of the pipeline grid failed; raised on every rank with the failing rank's report.

    Attributes:
        report: the failing rank's message, starting with ``"rank R (stage J, replica D)"``.

    Example:
        >>> try:  # on every rank
        ...     loss = pipe.step(x, y, loss_fn)
        ... except PipelineError as error:
        ...     print(error.report)  # doctest: +SKIP
        rank 1 (stage 1, replica 0) ...
    """

    def __init__(self, report: str, *, here: Where | None = None) -> None:
        self.report = report
        seen = "" if here is None or report.startswith(str(here)) else f" (seen by {here})"
        super().__init__(f"pipeline failed: {report}{seen}")


class FailureBoard:
    """The c10d store where the first failing rank posts its report for all others to read.

    Args:
        store: a store shared by every rank of the grid (the default process group's).
        prefix: unique per pipeline, the same on all of its ranks.
        here: this rank's place, to name it in reports.
    """

    def __init__(self, store: dist.Store, prefix: str, here: Where) -> None:
        self._store = dist.PrefixStore(prefix, store)
        self.here = here

    def post(self, error: BaseException, doing: str | None = None) -> str:
        """Post this rank's report unless a failure is already posted; return the board's report.

        Args:
            error: what this rank raised.
            doing: what it was running, e.g. ``"forward of micro-batch 2"``.
        """
        where = f"{self.here} failed in the {doing}" if doing else str(self.here)
        message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        report = f"{where}: {message}"
        try:
            posted = self._store.compare_set(_KEY, "", report)
            report = posted.decode() if isinstance(posted, bytes) else str(posted)
        except Exception:  # the store itself is gone; keep our own report
            logger.exception("could not post the failure of %s", self.here)
        return report

    def read(self, *, wait_s: float = 0.0) -> str | None:
        """The posted report, waiting up to ``wait_s`` seconds for one to appear."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._store.check([_KEY]):
                    return self._store.get(_KEY).decode()
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class CommError(RuntimeError):
    """A receive, send or collective of the pipeline failed or timed out on this rank."""


class StallError(CommError):
    """A wait of the pipeline ran out of time: the peer neither answered nor failed.

    Args:
        what: what the rank waited for, e.g. ``"receiving activation 3 for stage 2 from rank 1
            (stage 1)"``.
        timeout: the seconds it waited.
        others: what the other ranks were doing meanwhile, when known.
    """

    def __init__(self, what: str, timeout: float, others: str = "") -> None:
        self.what, self.timeout, self.others = what, timeout, others
        seen = f" [{others}]" if others else ""
        super().__init__(f"{what}: no answer within timeout={timeout:g} s{seen}; {_STALL_FIX}")

    def __reduce__(self) -> tuple[type[StallError], tuple[str, float, str]]:
        return (StallError, (self.what, self.timeout, self.others))


@contextmanager
def comm(what: str) -> Iterator[None]:
    """Turn an error of the torch.distributed calls in the block into :class:`CommError`."""
    try:
        yield
    except CommError:
        raise
    except Exception as error:
        raise CommError(f"{what} failed: {error}") from error


def wait(work: dist.Work | None, what: str, within: timedelta | None = None) -> None:
    """Wait for ``work``; turn a backend error into :class:`CommError` saying what was awaited.

    ``None`` (what torch returns to a rank outside the group) is nothing to wait for. With
    ``within``, the CPU waits at most that long (gloo's works honour it exactly) and a wait
    that runs out of time raises :class:`StallError`.
    """
    if work is None:
        return
    try:  # not comm(): a generator context manager costs more than the wait of a ready work
        work.wait() if within is None else work.wait(within)
    except Exception as error:
        if within is not None and any(words in str(error).lower() for words in _TIMED_OUT):
            raise StallError(what, within.total_seconds()) from error
        raise CommError(f"{what} failed: {error}") from error


def guarded(
    board: FailureBoard,
    close: Callable[[], None],
    fn: Callable[[], T],
    *,
    doing: Callable[[], str | None] = lambda: None,
    others: Callable[[], str] = lambda: "",
) -> T:
    """Run ``fn``; on any error post it (or adopt the posted one), close the groups, re-raise.

    The error that comes out names the rank that failed first: this rank for its own error, or
    the rank whose report is on the board when this rank only saw a broken connection or a
    timeout (then the failing rank had time to post before its connections closed). The
    original exception is the ``__cause__`` of the :class:`PipelineError`. A
    ``KeyboardInterrupt`` or ``SystemExit`` is posted too, then re-raised as it is. A
    :class:`StallError` nobody explained is posted with what the other ranks were doing.

    Args:
        board: where failures are posted.
        close: closes this rank's pipeline groups, so blocked peers wake up.
        fn: the work.
        doing: says what the rank was running when it failed, for the report.
        others: says what the other ranks were doing, for the report of a stall.
    """
    try:
        return fn()
    except PipelineError as error:
        release_works(error)
        close()
        raise
    except Exception as error:
        posted = board.read(wait_s=_REPORT_GRACE_S) if isinstance(error, CommError) else None
        shown = error
        if posted is None and isinstance(error, StallError):  # say where every rank got to
            shown = StallError(error.what, error.timeout, others())
        elif posted is None and isinstance(error, CommError):  # nobody said why: what it means
            shown = CommError(f"{error} [{_SILENT_PEER}]")
        report = posted if posted is not None else board.post(shown, doing())
        release_works(error)
        close()
        raise PipelineError(report, here=board.here) from error
    except BaseException as stop:  # KeyboardInterrupt, SystemExit: tell the peers, then stop
        board.post(stop, doing())
        release_works(stop)
        close()
        raise


def release_works(error: BaseException) -> None:
    """Drop the communication works that the frames of ``error``'s tracebacks still hold.

    A gloo work, even a finished one, keeps its group's connections open after the group is
    destroyed, so a peer blocked on this rank would wait out its timeout instead of seeing the
    connection close. The works live in the locals of the frames of pipepar's pipes across ranks
    and of torch.distributed on the traceback (of the error and of its causes); those frames are
    cleared. The user's frames (layers, loss_fn) keep their locals for post-mortem debugging.
    """
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_COMM_DIRS):
                with contextlib.suppress(RuntimeError):  # a frame still running keeps its locals
                    tb.tb_frame.clear()
            tb = tb.tb_next
        pending += [e.__cause__, e.__context__]
