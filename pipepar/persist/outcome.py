"""How a save that several processes take part in went, told alike to every one of them.

A process that fails must not leave its peers waiting in a collective, nor let them report
success: after each step of a collective save, every process learns whether any failed. The
process that failed raises its own error (an ``OSError`` for a full disk), the others
:class:`NotSaved` naming it. ``torch.distributed.checkpoint`` does this for its own steps, with
a ``CheckpointException`` listing every process's error: :func:`from_dcp` turns it into the
same pair.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["NotSaved", "from_dcp", "together"]


class NotSaved(RuntimeError):
    """Raised on the processes of a save that did not fail themselves: another one did."""

    def __init__(self, target: Path, reason: str) -> None:
        super().__init__(f"checkpoint {target} was not saved: {reason}")
        self.reason = reason
        """Which process could not write it, and its error."""


def together(
    step: Callable[[], object] | None, group: dist.ProcessGroup | None, target: Path
) -> None:
    """``step()`` here (``None``: nothing to do here); if it failed on any process of
    ``group``, every one raises: the failed one its own error, the others :class:`NotSaved`."""
    error: Exception | None = None
    try:
        if step is not None:
            step()
    except Exception as e:
        error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = [message]
    if group is not None:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise NotSaved(target, f"{_rank(rank, group)} could not write it: {message}")


def from_dcp(
    error: CheckpointException, group: dist.ProcessGroup | None, target: Path
) -> Exception:
    """What this process raises after DCP's ``error``: its own error out of DCP's report of
    every process's, or :class:`NotSaved` naming the first one that failed."""
    failures = error.failures
    me = 0 if group is None else dist.get_rank(group)
    own = failures[me][0] if me in failures else None
    if isinstance(own, Exception):
        return own
    rank, (first, _) = next(iter(failures.items()))
    reason = f"{_rank(rank, group)} could not write it: {type(first).__name__}: {first}"
    return NotSaved(target, reason)


def _rank(rank: int, group: dist.ProcessGroup | None) -> str:
    return "this process" if group is None else f"rank {dist.get_global_rank(group, rank)}"
