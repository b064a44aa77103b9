"""Micro-batches the caller made: ``pipe.step(microbatches=[...], targets=[...])``.

A pipe splits a mini-batch into ``chunks`` micro-batches by rows. Some batches are not rows of
one tensor: sequences of different lengths bucketed into micro-batches, packed documents cut
at their boundaries, micro-batches balanced by tokens. Then the caller makes the micro-batches
and the pipe runs them as they are, as many as given (the schedule is built for that count).

This module only checks what ``step`` was given and keeps it; from there the given
micro-batches meet the ones a pipe splits itself (a list of micro-batch inputs and targets)
and everything after is shared: the loss of each is joined into the whole batch's by the
shares of :mod:`pipepar.core.losses`, learned from micro-batch 0, each micro-batch's count
recomputed from its own inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Given", "check_given"]


@dataclass(frozen=True)
class Given:
    """The micro-batches a caller made, and with a ``loss_fn`` one target per micro-batch."""

    microbatches: list[Any]
    targets: list[Any] | None = None

    def targets_on(self, device: torch.device | None) -> list[Any]:
        """One target per micro-batch (``None`` each without targets), its tensors moved to
        ``device`` (the last stage's, where the loss is computed)."""
        if self.targets is None:
            return [None] * len(self.microbatches)
        if device is None:
            return list(self.targets)

        def there(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.device != device:
                return leaf.to(device, non_blocking=device.type == "cuda")
            return leaf

        return [pytree.tree_map(there, t) for t in self.targets]


def check_given(
    microbatches: Any,
    targets: Any,
    *,
    loss_fn: Any,
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> tuple[Given | None, dict[str, Any]]:
    """What ``step(microbatches=..., targets=...)`` was given, checked, and the keyword
    arguments left for the model.

    Without ``microbatches`` the pipe splits the batch (None), and a ``targets=`` is the
    model's own keyword argument (nanoGPT's ``forward(idx, targets)``): it goes back into
    ``kwargs``. With them, ``targets`` is one target per micro-batch for ``loss_fn``.

    Raises:
        TypeError: ``microbatches`` is not a list, comes with the batch's own arguments or a
            whole ``target=``; ``targets`` without ``loss_fn``.
        ValueError: an empty list, or ``targets`` of another length than ``microbatches``.

    Example:
        >>> given, _ = check_given([torch.zeros(2, 3), torch.zeros(1, 3)], None, loss_fn=None,
        ...                        target=None, args=(), kwargs={})
        >>> len(given.microbatches)
        2
    """
    if microbatches is None:
        return None, kwargs if targets is None else {**kwargs, "targets": targets}
    _check_list(microbatches, "microbatches")
    if args or kwargs:
        given = [f"{len(args)} positional"] if args else []
        given += [f"keywords {sorted(kwargs)}"] if kwargs else []
        raise TypeError(
            f"step() got microbatches= and the batch's own arguments ({' and '.join(given)}); "
            "pass the mini-batch either whole as the model's arguments (the pipe splits it "
            "into chunks) or already split as microbatches=[...], each micro-batch's "
            "arguments in it, not both"
        )
    if target is not None:
        raise TypeError(
            f"step() got microbatches= ({len(microbatches)} micro-batches) and target=, a "
            "whole batch's target; pass one target per micro-batch as targets=[...]"
        )
    if targets is None:
        return Given(list(microbatches)), kwargs
    if loss_fn is None:
        raise TypeError(
            "step() got targets= without loss_fn=; the targets are what loss_fn(output, "
            "target) reads: pass loss_fn= too, or, for the model's own loss, put its labels "
            "in each micro-batch (e.g. {'input_ids': ids, 'labels': ids}) and no targets="
        )
    _check_list(targets, "targets")
    if len(targets) != len(microbatches):
        raise ValueError(
            f"targets has {len(targets)} entries but microbatches has {len(microbatches)}; "
            "pass one target per micro-batch, in the same order"
        )
    return Given(list(microbatches), list(targets)), kwargs


def _check_list(value: Any, name: str) -> None:
    if not isinstance(value, list):
        raise TypeError(
            f"{name} must be a list (one entry per micro-batch), but got "
            f"{type(value).__name__}; pass {name}=[mb0, mb1, ...]"
        )
    if not value:
        raise ValueError(
            f"{name} is an empty list, but a step needs at least one micro-batch; pass "
            f"{name}=[mb0, mb1, ...] with one entry per micro-batch"
        )
