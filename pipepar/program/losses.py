"""The loss of a model pipe's step: ``loss_fn(output, target)`` or the model's own.

With ``loss_fn``, micro-batch losses join by :mod:`pipepar.core.losses`. The model's own loss
(``labels=``) is joined by :class:`ModelLoss`: a transformers model averages its token loss over
the labels that are not ``-100``, a different number in each micro-batch, unless it is given
``num_items_in_batch``, the count of the whole batch, by which it then divides a summed loss.
The pipe passes that count to every micro-batch call (the caller's own, as HF Trainer passes
it, or the batch's real labels counted as transformers' Trainer counts them), so each
micro-batch returns its part of the batch's loss and the parts add up. A model that takes the
keyword but computes its loss without it (some models build a ``CrossEntropyLoss`` of their
own) is seen not to use it, and its micro-batch means are weighted by their label counts.
A model whose loss pipepar cannot count is joined by rows.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipepar.core.losses import LossFn, LossShares, loss_shares, nothing, scalar_loss
from pipepar.program.calls import Call

__all__ = ["LossFn", "ModelLoss", "Shares", "callers", "loss_head", "own_loss", "step_shares"]

_IGNORE = -100  # transformers' label for "no target here"


def loss_head(
    shares: Shares, targets: Sequence[Any]
) -> Callable[[Any, int], Tensor]:
    """Micro-batch ``i``'s loss: ``shares``' function (``loss_fn``) or the model's own."""
    if isinstance(shares, LossShares):
        return shares.head(targets)
    return shares.head


def step_shares(
    loss_fn: LossFn | None,
    model: nn.Module,
    calls: Sequence[Call],
    targets: Sequence[Any],
    items: Any = None,
) -> Shares:
    """How ``step`` joins its micro-batch losses: by ``loss_fn``'s rule, or the model's."""
    rows = [c.rows for c in calls]
    if loss_fn is not None:
        return loss_shares(loss_fn, targets, rows, items)
    return ModelLoss(model, calls)


class ModelLoss(Sequence[float]):
    """The model's own loss over micro-batches: what each call adds and each loss's share.

    A sequence of the micro-batches' shares (read once a micro-batch's forward has run: whether
    the model used ``num_items_in_batch`` is known only then).

    Args:
        model: the model (its ``forward`` signature and ``loss_type`` tell how it counts).
        calls: the micro-batch calls.
    """

    def __init__(self, model: nn.Module, calls: Sequence[Call]) -> None:
        self.rows = [c.rows for c in calls]
        self.counts = _label_counts(model, calls) if _takes_count(model) else None
        given = calls[0].kwargs.get("num_items_in_batch") if calls else None
        self.given = given is not None
        # What the shares divide by: real labels (or rows) of this batch, or of every replica's.
        self.total: float | None = float(sum(self.counts) if self.counts else sum(self.rows))
        self._passed = float(given) if given is not None else self.total
        self._replicas = 1
        self._used = [threading.Event() for _ in calls]

    def spread(self, total: float | None, replicas: int) -> ModelLoss:
        """This batch as one of ``replicas`` whose gradients are averaged, holding ``total``
        labels (or rows) in all: the loss becomes the whole global batch's."""
        self._replicas = replicas
        if total:
            self.total = total
            if not self.given and self.counts is not None:
                self._passed = total
        return self

    # -- what each micro-batch's call gets -----------------------------------------------
    def call_kwargs(self, i: int) -> dict[str, Any]:
        """The keyword arguments to add to micro-batch ``i``'s call."""
        if self.counts is None and not self.given:
            return {}
        n = torch.tensor(self._passed if self._passed else 1.0)
        return {"num_items_in_batch": _Watched.of(n, self._used[i])}

    # -- the shares -----------------------------------------------------------------------------
    @property
    def weights(self) -> ModelLoss:
        """The shares, as :attr:`LossShares.weights <pipepar.core.losses.LossShares>`: this
        sequence itself (each read once its micro-batch's forward has run)."""
        return self

    def weight(self, i: int) -> float:
        if self._used[i].is_set():
            return float(self._replicas)  # the model divided its sum by the whole count
        part = self.counts[i] if self.counts is not None else self.rows[i]
        return part / self.total * self._replicas if self.total else 0.0

    def empty(self, i: int) -> bool:
        """Micro-batch ``i`` holds no label and its loss is a mean over none (``nan``)."""
        return not self._used[i].is_set() and self.counts is not None and self.counts[i] == 0

    def head(self, output: Any, i: int) -> Tensor:
        loss = own_loss(output)
        if self.empty(i):
            return nothing(output)
        return scalar_loss(loss, "the model")

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        return self.weight(i)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[float]:
        return (self.weight(i) for i in range(len(self.rows)))


Shares = LossShares | ModelLoss
"""How a step's micro-batch losses are joined: by a ``loss_fn``'s rule, or the model's own."""


def callers(
    model: nn.Module, calls: Sequence[Call], shares: Shares | None
) -> list[Callable[[], Any]]:
    """Each micro-batch's call of the model, with what the model's own loss needs added
    (``num_items_in_batch``: see :class:`ModelLoss`)."""

    def caller(i: int, c: Call) -> Callable[[], Any]:
        extra = shares.call_kwargs(i) if isinstance(shares, ModelLoss) else {}
        return lambda: model(*c.args, **{**c.kwargs, **extra})

    return [caller(i, c) for i, c in enumerate(calls)]


def own_loss(output: Any) -> Any:
    """The loss a model returned: ``output.loss``, ``output["loss"]``, or the first element of
    a tuple (as transformers models return it given ``labels=``)."""
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


# -- counting labels as transformers does ---------------------------------------------------
def _takes_count(model: nn.Module) -> bool:
    """Whether the model's forward takes ``num_items_in_batch`` (by name or ``**kwargs``)."""
    if getattr(model, "accepts_loss_kwargs", True) is False:
        return False
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params)


def _label_counts(model: nn.Module, calls: Sequence[Call]) -> list[float] | None:
    """Each micro-batch's count of real labels (``!= -100``), shifted by one for causal language
    models (their first label predicts nothing); None without integer ``labels``."""
    shifts = _shifts_labels(model)
    counts = []
    for c in calls:
        labels = c.kwargs.get("shift_labels")
        if labels is None:
            labels = c.kwargs.get("labels")
            if isinstance(labels, Tensor) and shifts:
                labels = labels[..., 1:]
        if not isinstance(labels, Tensor) or labels.is_floating_point():
            return None
        counts.append(float((labels != _IGNORE).sum()))
    return counts


def _shifts_labels(model: nn.Module) -> bool:
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # not a transformers model
        return False
    unwrap = getattr(model, "get_base_model", None)  # an adapter wrapper (PEFT): its model's
    model = unwrap() if callable(unwrap) else model
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False  # the decoder's labels are aligned with its right-shifted inputs
    # The loss the model computes: its loss_type's, or transformers' default for none.
    loss_type = getattr(model, "loss_type", None)
    fn = LOSS_MAPPING.get(loss_type) if loss_type is not None else None
    if fn is None and "_loss_function" not in vars(model):
        fn = ForCausalLMLoss if hasattr(type(model), "loss_function") else None
    return fn is ForCausalLMLoss


class _Watched(Tensor):
    """``num_items_in_batch`` as handed to the model: notes when a torch operation uses it."""

    _pipepar_used: threading.Event

    @staticmethod
    def of(value: Tensor, used: threading.Event) -> _Watched:
        watched = value.as_subclass(_Watched)
        watched._pipepar_used = used
        return watched

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, _Watched):
                value._pipepar_used.set()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
