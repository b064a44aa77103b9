"""Fault reporting: one rank's error ends every rank of the pipeline grid with that error.

A rank that raises posts "rank r (stage j, replica d): Error: message" to the c10d store, then
closes its pipeline process groups. Peers blocked on a receive or a collective with that rank
see the connection close (or, at the latest, their group timeout expire), read the store and
raise :class:`PipelineError` naming the failing rank and stage; they close their own groups in
turn, so the failure spreads along the grid within a bounded time instead of hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

__all__ = ["CommError", "FailureBoard", "PipelineError", "Where", "comm", "guarded", "wait"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a peer that saw a communication error waits for a report to appear. The failing
#: rank posts before it closes its connections, so the report is normally there already.
_REPORT_GRACE_S = 0.25
_KEY = "failure"


@dataclass(frozen=True)
class Where:
    """A rank's place in the pipeline grid, used to name it in error messages."""

    rank: int
    """Global rank."""
    stage: int
    """Stage index (position in the pipeline)."""
    replica: int
    """Data-parallel replica index."""

    def __str__(self) -> str:
        return f"rank {self.rank} (stage {self.stage}, replica {self.replica})"


class PipelineError(RuntimeError):
    """A rank of the pipeline grid failed; raised on every rank with the failing rank's report.

    Attributes:
        report: the failing rank's message, starting with ``"rank R (stage J, replica D)"``.
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

    def post(self, error: BaseException) -> str:
        """Post this rank's report unless a failure is already posted; return the board's report."""
        report = f"{self.here}: {type(error).__name__}: {error}"
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


@contextmanager
def comm(what: str) -> Iterator[None]:
    """Turn an error of the torch.distributed calls in the block into :class:`CommError`."""
    try:
        yield
    except CommError:
        raise
    except Exception as error:
        raise CommError(f"{what} failed: {error}") from error


def wait(work: dist.Work | None, what: str) -> None:
    """Wait for ``work``; turn a backend error into :class:`CommError` saying what was awaited.

    ``None`` (what torch returns to a rank outside the group) is nothing to wait for.
    """
    if work is not None:
        with comm(what):
            work.wait()


def guarded(board: FailureBoard, close: Callable[[], None], fn: Callable[[], T]) -> T:
    """Run ``fn``; on any error post it (or adopt the posted one), close the groups, re-raise.

    The error that comes out names the rank that failed first: this rank for its own error, or
    the rank whose report is on the board when this rank only saw a broken connection or a
    timeout (then the failing rank had time to post before its connections closed).
    """
    try:
        return fn()
    except PipelineError:
        close()
        raise
    except Exception as error:
        posted = board.read(wait_s=_REPORT_GRACE_S) if isinstance(error, CommError) else None
        report = posted if posted is not None else board.post(error)
        close()
        raise PipelineError(report, here=board.here) from error
