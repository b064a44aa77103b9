"""The loss of a pipe's training step: ``loss_fn(output, target)`` or the model's own.

Each micro-batch's loss is computed on the stage that finishes its forward; ``target`` is split
like the batch when it has the batch's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

__all__ = ["LossFn", "loss_head", "split_target"]

LossFn = Callable[[Any, Any], Tensor]


def split_target(target: Any, rows: list[int]) -> list[Any]:
    total = sum(rows)
    if isinstance(target, Tensor) and target.dim() > 0 and target.shape[0] == total:
        return list(target.split(rows))
    return [target] * len(rows)


def loss_head(loss_fn: LossFn | None, targets: list[Any]) -> Callable[[Any, int], Tensor]:
    def head(output: Any, i: int) -> Tensor:
        loss = loss_fn(output, targets[i]) if loss_fn is not None else _own_loss(output)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the loss must be a scalar tensor, but got {type(loss).__name__}"
                f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, Tensor) else ''}; "
                "reduce it (e.g. reduction='mean')"
            )
        return loss.reshape(())

    return head


def _own_loss(output: Any) -> Any:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, Tensor):
        loss = output
    if loss is None:
        raise TypeError(
            f"the model returned {type(output).__name__} with no loss; pass the labels the "
            "model takes (e.g. labels=input_ids) or step(..., loss_fn=fn, target=y)"
        )
    return loss
