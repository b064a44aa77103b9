"""How the losses of the micro-batches make the loss of the whole batch.

A pipe computes ``loss_fn(output_i, target_i)`` on each micro-batch ``i`` and starts that
micro-batch's backward from it, scaled by its *share*; the batch's loss is the sum of the
shares times the micro-batch losses. The shares must make that sum equal the loss the plain
model computes on the whole batch, and every gradient with it, so they depend on what the loss
divides by:

* **rows** (``F.mse_loss``, ``F.cross_entropy`` on class probabilities, any loss that averages
  over the batch): micro-batch ``i`` with ``r_i`` of the ``R`` rows has share ``r_i / R``.
* **items** (``F.cross_entropy`` / ``F.nll_loss`` with ignored targets, ``ignore_index``, class
  ``weight=``; a custom loss with ``items=``): the loss averages over items the target says
  are real, a different number in each micro-batch. torch's losses are computed with
  ``reduction="sum"`` and divided by the whole batch's count, so a micro-batch without a real
  item adds exactly nothing (no ``0 / 0``). A custom loss that averages over the items that
  ``items(target_i)`` counts gets share ``c_i / C``, and a micro-batch with ``c_i = 0`` is left
  out (its backward still runs, with a zero gradient).
* **sum** (``reduction="sum"``): every share is 1.

The counts come from the targets before any forward runs, so every schedule can start a
micro-batch's backward as soon as its loss exists.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

__all__ = [
    "Items",
    "LossFn",
    "LossShares",
    "loss_shares",
    "joined_loss",
    "nothing",
    "scalar_loss",
    "split_target",
    "weighted_sum",
]

LossFn = Callable[[Any, Any], Tensor]
"""``loss_fn(output, target) -> scalar tensor``."""

Items = Callable[[Any], "int | Tensor"]
"""``items(target) -> how many items a micro-batch's loss averages over``."""

_CLASS_LOSSES = {F.cross_entropy: nn.CrossEntropyLoss, F.nll_loss: nn.NLLLoss}


@dataclass
class LossShares:
    """Each micro-batch's loss function and share of the batch's loss.

    Attributes:
        fns: the function applied to micro-batch ``i``'s output and target (the user's, or a
            copy of a torch loss with ``reduction="sum"``); ``None`` where the micro-batch
            holds no item (its loss is :func:`nothing`).
        weights: micro-batch ``i``'s share: the gradient its backward starts from.
    """

    fns: list[LossFn | None]
    weights: list[float]
    total: float | None = None
    """What the shares divide by (rows or items of the batch); None for a summed loss."""

    def spread(self, total: float | None, replicas: int) -> LossShares:
        """The shares of this batch as one of ``replicas`` data-parallel batches holding
        ``total`` rows or items in all, whose gradients are averaged over the replicas: the
        loss of the whole global batch, each replica's loss weighted by its part."""
        scale = float(replicas)
        if self.total is not None and total:
            scale *= self.total / total
        return LossShares(self.fns, [w * scale for w in self.weights], total)

    def head(self, targets: Sequence[Any]) -> Callable[[Any, int], Tensor]:
        """The loss of micro-batch ``i``'s output, a scalar tensor (checked)."""

        def head(output: Any, i: int) -> Tensor:
            fn = self.fns[i]
            return nothing(output) if fn is None else scalar_loss(fn(output, targets[i]))

        return head


def loss_shares(
    loss_fn: LossFn, targets: Sequence[Any], rows: Sequence[int], items: Items | None = None
) -> LossShares:
    """The shares of the micro-batch losses ``loss_fn(output_i, targets[i])`` (see the module
    docstring for the rules).

    Args:
        loss_fn: the loss of one micro-batch; torch's losses are recognised (functions,
            ``functools.partial`` of them and ``nn`` loss modules, by their ``reduction``,
            ``ignore_index`` and ``weight``).
        targets: each micro-batch's target.
        rows: each micro-batch's rows.
        items: for a custom loss that averages over a count other than rows:
            ``items(target_i)`` gives micro-batch ``i``'s count.

    Example:
        >>> y = torch.tensor([1, -100, -100, -100])
        >>> s = loss_shares(F.cross_entropy, list(y.split(2)), [2, 2])
        >>> s.weights  # one real target in all: the sum over the batch divided by 1
        [1.0, 1.0]
    """
    m = len(rows)
    if items is not None:
        return _custom_items(loss_fn, targets, items)
    reduction = _reduction(loss_fn)
    if reduction == "sum":
        return LossShares([loss_fn] * m, [1.0] * m)
    counted = _class_loss(loss_fn, targets)
    if counted is not None and reduction == "mean":
        summed, counts = counted
        total = sum(counts)
        # No real target anywhere: every sum is 0, and so is the loss (not 0 / 0).
        return LossShares([summed] * m, [1.0 / max(total, 1e-30)] * m, total)
    total_rows = sum(rows)
    return LossShares([loss_fn] * m, [r / total_rows for r in rows], float(total_rows))


def weighted_sum(values: Sequence[Tensor], shares: Sequence[float]) -> Tensor:
    """``sum(share * value)`` over the micro-batches whose share is not 0 (a value there may be
    ``nan``: a mean over nothing)."""
    terms = [v * w for v, w in zip(values, shares) if w != 0]
    return sum(terms[1:], terms[0]) if terms else torch.zeros_like(values[0])


def joined_loss(values: Sequence[Any], shares: Sequence[float]) -> Tensor:
    """The batch's loss: each micro-batch's loss value (a one-element tensor or a number, as
    the last stage returned it) times its share, as a detached float scalar."""
    losses = [torch.as_tensor(v).reshape(()).detach().float() for v in values]
    return weighted_sum(losses, shares)


def split_target(target: Any, rows: Sequence[int], device: torch.device | None = None) -> list[Any]:
    """``target`` split like the batch: tensors with the batch's rows on dimension 0 (also
    inside a tuple, list or dict) are split into the micro-batches' rows, anything else goes
    to every micro-batch whole.

    Raises:
        ValueError: a tensor target with a batch dimension of another size.
    """
    total = sum(rows)
    leaves, spec = pytree.tree_flatten(target)
    columns = [_split_leaf(leaf, rows, total, device, len(leaves) == 1) for leaf in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(len(rows))]


def nothing(output: Any) -> Tensor:
    """A zero loss that is still a function of ``output``: its backward runs and gives zero
    gradients (a micro-batch without a real item)."""
    leaves = pytree.tree_leaves(output)
    floats = [t for t in leaves if isinstance(t, Tensor) and t.is_floating_point()]
    if not floats:
        return torch.zeros(())
    return sum((t.sum() * 0.0 for t in floats[1:]), floats[0].sum() * 0.0)


# -- what a loss divides by -------------------------------------------------------------------
def _reduction(loss_fn: LossFn) -> str:
    """``"sum"``, ``"mean"`` or ``"unknown"`` (a custom function: treated as a mean over rows)."""
    if isinstance(loss_fn, nn.modules.loss._Loss):
        return str(loss_fn.reduction)
    fn, kwargs = _unpartial(loss_fn)
    if fn in _CLASS_LOSSES or getattr(fn, "__module__", "") == "torch.nn.functional":
        return str(kwargs.get("reduction", "mean"))
    return "unknown"


def _class_loss(loss_fn: LossFn, targets: Sequence[Any]) -> tuple[LossFn, list[float]] | None:
    """For cross-entropy and NLL losses on class indices: a ``reduction="sum"`` copy and each
    micro-batch's count (targets not ignored, weighted by their class weight), else None."""
    module = _as_class_module(loss_fn)
    if module is None or not all(_class_indices(t) for t in targets):
        return None
    summed = _with_sum(module)
    return summed, [_count(module, t) for t in targets]


def _as_class_module(loss_fn: LossFn) -> nn.Module | None:
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return loss_fn
    fn, kwargs = _unpartial(loss_fn)
    cls = _CLASS_LOSSES.get(fn)  # type: ignore[call-overload]
    if cls is None or not set(kwargs) <= {"weight", "ignore_index", "reduction", "label_smoothing"}:
        return None
    if "label_smoothing" in kwargs and cls is not nn.CrossEntropyLoss:
        return None
    return cls(**kwargs)


def _with_sum(module: nn.Module) -> LossFn:
    summed = copy.copy(module)
    summed.reduction = "sum"  # type: ignore[assignment]
    return summed


def _count(module: nn.Module, target: Tensor) -> float:
    real = target.ne(cast(int, module.ignore_index))
    weight = cast("Tensor | None", module.weight)
    if weight is None:
        return float(real.sum())
    return float(weight.to(target.device)[target[real]].sum())


def _class_indices(target: Any) -> bool:
    return isinstance(target, Tensor) and not target.is_floating_point()


def _unpartial(loss_fn: Any) -> tuple[Any, dict[str, Any]]:
    kwargs: dict[str, Any] = {}
    while isinstance(loss_fn, functools.partial) and not loss_fn.args:
        kwargs = {**loss_fn.keywords, **kwargs}
        loss_fn = loss_fn.func
    return loss_fn, kwargs


def _custom_items(loss_fn: LossFn, targets: Sequence[Any], items: Items) -> LossShares:
    if not callable(items):
        raise TypeError(
            f"items must be callable (items(target) -> count), but got {type(items).__name__}; "
            "e.g. items=lambda y: (y != -100).sum()"
        )
    counts = [float(items(t)) for t in targets]
    total = sum(counts)
    fns: list[LossFn | None] = [loss_fn if c > 0 else None for c in counts]
    return LossShares(fns, [c / total if total > 0 else 0.0 for c in counts], total)


def _split_leaf(
    leaf: Any, rows: Sequence[int], total: int, device: torch.device | None, alone: bool
) -> list[Any]:
    if not isinstance(leaf, Tensor) or leaf.dim() == 0:
        return [leaf] * len(rows)
    if leaf.shape[0] != total:
        if not alone:  # one of several values: something other than per-row targets
            return [leaf] * len(rows)
        raise ValueError(
            f"target has {leaf.shape[0]} rows but the input has {total}; pass one target row "
            "per input row"
        )
    if device is not None:
        leaf = leaf.to(device, non_blocking=device.type == "cuda")
    return list(leaf.split(list(rows)))


def scalar_loss(loss: Any, what: str = "loss_fn") -> Tensor:
    """``loss`` as a 0-dim tensor; a TypeError naming ``what`` returned something else."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
        raise TypeError(
            f"{what} must return a scalar tensor, but returned {type(loss).__name__}{shape}; "
            "reduce it, e.g. with reduction='mean'"
        )
    return loss.reshape(())
