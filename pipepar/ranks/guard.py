"""Guard: a pipe's calls that talk to peers, run so that one rank's failure or stall ends every
rank of the grid with one report.

Both distributed pipes (``nn.Sequential`` and any model) run each ``step`` (and every other call
that talks to peers) through their :class:`Guard`: on an error it posts the report to the
pipeline's :class:`~pipepar.ranks.failure.FailureBoard` (or adopts the one posted
first), with what every peer was doing when the error is a stall
(:class:`~pipepar.ranks.progress.ProgressBoard`), and closes the pipeline's groups so
that blocked peers wake up and raise the same report. Once closed, the pipe refuses every call
with that report. The guard does not know what a step is; the pipes' runtimes tell the mesh's
:class:`~pipepar.ranks.progress.Progress`.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from pipepar.ranks.failure import FailureBoard, PipelineError, guarded
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.progress import ProgressBoard

__all__ = ["Guard"]

T = TypeVar("T")

_built: Counter[tuple[int, ...]] = Counter()  # pipes built per grid, to keep store keys apart


class Guard:
    """Runs ``fn`` under :func:`~pipepar.ranks.failure.guarded` for a pipe; refuses once
    the pipe is closed.

    Args:
        owner: the pipe (its progress board stops when it is garbage-collected).
        mesh: the pipe's grid position, groups and progress.
        close: closes the pipe (its groups), so that blocked peers wake up.

    Example:
        >>> guard = Guard(pipe, pipe.mesh, pipe.close)  # doctest: +SKIP
        >>> loss = guard(lambda: pipe._step(x, y, loss_fn))  # doctest: +SKIP
    """

    def __init__(self, owner: object, mesh: Mesh, close: Callable[[], None]) -> None:
        store, prefix = dist.distributed_c10d._get_default_store(), _prefix(mesh)
        self.mesh, self._close = mesh, close
        self.board = FailureBoard(store, prefix, mesh.where)
        mesh.progress.posted = self.board.read
        peers = sorted(set(mesh.pipeline_ranks + mesh.replica_ranks) - {mesh.where.rank})
        self.progress = ProgressBoard(mesh.progress, store, prefix, mesh.where, peers)
        weakref.finalize(owner, self.progress.stop)  # a pipe dropped without close()
        self.failure = "closed by close()"
        """Why the pipe is closed: the report of the failure that closed it, if one did."""

    def __call__(self, fn: Callable[[], T]) -> T:
        """``fn()``; raises :class:`~pipepar.ranks.failure.PipelineError` on every rank
        when any rank fails or stalls."""
        if self.mesh.closed:
            raise PipelineError(f"{self.failure} (the pipeline is closed; build a new one)")
        try:
            value = guarded(
                self.board,
                self._close,
                fn,
                doing=lambda: self.mesh.progress.doing,
                others=self.progress.others,
            )
        except PipelineError as error:
            self.failure = error.report
            raise
        self.mesh.progress.end_step()
        return value

    def stop(self) -> None:
        """Stop publishing this rank's progress (the pipe is closed)."""
        self.progress.stop()


def _prefix(mesh: Mesh) -> str:
    """Store keys of this pipeline: unique per grid and pipe built on it, the same on every
    rank of the grid (all ranks build their pipes in one order)."""
    grid = tuple(mesh.grid_ranks)
    _built[grid] += 1
    return f"pipepar/{'-'.join(map(str, grid))}/{_built[grid]}/"
