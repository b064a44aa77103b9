"""The loss of a model pipe's step: ``loss_fn(output, target)`` or the model's own.

With ``loss_fn``, micro-batch losses join by :mod:`pipepar.core.losses`. The model's own loss
(a nanoGPT ``forward(idx, targets)`` returning ``(logits, loss)``, a transformers model given
``labels=``, a dict with a loss in it) is found and joined by :class:`ModelLoss`: micro-batch
0's forward runs under a :class:`~pipepar.core.reductions.Probe` the first time a kind of call
is seen, which tells which leaves of the output are reduced over the batch and what each
divides by; later calls of that kind reuse what was learned (:class:`Forms`), with each
micro-batch's count recomputed from its own inputs. A batch cut between packed documents is
checked there too: the forward must keep documents apart
(:class:`~pipepar.core.document_mixing.DocumentWatch`) and the loss's counts add up to the
whole batch's. Whatever the model is given whole (a
``num_items_in_batch`` the caller passes, as HF Trainer does) is a constant of the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching.calls import Call, Parts, parts_of
from pipepar.batching.rules import argument_keys
from pipepar.core.batch_dims import accepting
from pipepar.core.document_mixing import DocumentWatch
from pipepar.core.forms import Form, is_reduced
from pipepar.core.losses import (
    LossFn,
    LossNotJoinable,
    LossShares,
    nothing,
    scalar_loss,
)
from pipepar.core.reductions import Probe
from pipepar.program.route import signature

__all__ = [
    "Forms",
    "LossFn",
    "ModelLoss",
    "Shares",
    "callers",
    "loss_head",
    "step_shares",
    "watcher",
]


class Forms:
    """What a model's outputs are, by kind of call: the :data:`~pipepar.core.reductions.Form`
    of each output leaf, learned once from micro-batch 0's forward."""

    def __init__(
        self, model: nn.Module, batch_coupling: str = "error", deferred_batch_norm: bool = False
    ) -> None:
        self._model, self._settings = model, (batch_coupling, deferred_batch_norm)
        self.accepts = accepting(batch_coupling, deferred_batch_norm)
        self.per_micro_batch = batch_coupling == "per-micro-batch"
        self._learned: dict[Hashable, Learned] = {}
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Forms, (self._model, *self._settings))  # relearned after a copy

    def names(self) -> dict[int, str]:
        """Module paths by ``id`` (for messages)."""
        return {
            id(m): path or f"{type(m).__name__} (the model)"
            for path, m in self._model.named_modules()
        }

    def constants(self) -> list[Tensor]:
        """The model's weights and buffers as they are now (placed, or kept on meta)."""
        return [*self._model.parameters(), *self._model.buffers()]

    def get(self, key: Hashable) -> Learned | None:
        with self._lock:
            return self._learned.get(key)

    def keep(self, key: Hashable, forms: Learned) -> None:
        with self._lock:
            self._learned[key] = forms


def loss_head(
    shares: Shares, targets: Sequence[Any], loss_fn: LossFn | None = None
) -> Callable[[Any, int], Tensor]:
    """Micro-batch ``i``'s loss: ``loss_fn``'s (its shares learned from it) or the model's own."""
    if isinstance(shares, ModelLoss):
        return shares.head
    assert loss_fn is not None
    return shares.head_of(loss_fn, targets)


def step_shares(
    loss_fn: LossFn | None,
    model: nn.Module,
    calls: Sequence[Call],
    targets: Sequence[Any],
    items: Any = None,
    forms: Forms | None = None,
) -> Shares:
    """How ``step`` joins its micro-batch losses: by ``loss_fn``'s form, or the model's."""
    from pipepar.core.losses import loss_shares

    if loss_fn is not None:
        return loss_shares(loss_fn, targets, [c.rows for c in calls], items)
    return ModelLoss(model, calls, forms if forms is not None else Forms(model), loss=True)


class ModelLoss(LossShares):
    """The model's own outputs over micro-batches: the forms of micro-batch 0's output leaves
    (learned by a probe of its forward, or known from an earlier call of the kind), the leaf
    that is the loss, and, as a sequence, that loss's shares.

    Args:
        model: the model.
        calls: the micro-batch calls.
        forms: what earlier calls learned, by kind.
        loss: whether the output must hold a loss (``step``), or may (``pipe(...)``).
    """

    def __init__(
        self, model: nn.Module, calls: Sequence[Call], forms: Forms, *, loss: bool
    ) -> None:
        sources = [c.batch_tensors() for c in calls]
        self._tracked = calls[0].tracked() if calls else 0
        batch = {id(t) for t in sources[0]} if sources else set()
        self._whole = [t for t in calls[0].tensors() if id(t) not in batch] if calls else []
        self._named_whole = _named(model, calls[0], batch) if len(calls) > 1 else []
        super().__init__([c.rows for c in calls], sources, what="the model's loss")
        self._cut: Parts = parts_of(calls)
        if self._cut.dim != 0:
            self.covering(self._cut.whole, sum(self._cut.rows))
        self._forms, self._needs_loss = forms, loss
        self.per_micro_batch = forms.per_micro_batch
        kind = signature(calls[0].args, calls[0].kwargs, model.training) if calls else None
        self.key = (kind, self._cut.dim)  # a document cut's first call is watched on its own
        learned = forms.get(self.key)
        self.leaf_forms: list[Form] | None = learned[0] if learned is not None else None
        self.loss_at: int | None = None
        self.resolve: Callable[[Tensor], Tensor | None] | None = None
        self._probe: Probe | None = None
        if learned is not None:
            self._take(*learned)

    # -- learning -----------------------------------------------------------------------------
    def watch(self, i: int, call: Callable[[], Any]) -> Callable[[], Any]:
        """Micro-batch ``i``'s call, under a probe if it is the one to learn from."""
        if i != 0 or self.leaf_forms is not None:
            return call

        def watched() -> Any:
            self._probe = Probe(
                self.sources[0],
                [*self._forms.constants(), *self._whole],
                rows=self.rows[0],
                names=self._forms.names(),
                resolve=self.resolve,
                accepts=self._forms.accepts if len(self.rows) > 1 else lambda c: True,
                tracked=self._tracked,
                rows_dim=self._cut.dim,
                whole=self._named_whole,
            )
            documents = DocumentWatch(self._cut.documents[0]) if self._cut.documents else None
            with self._probe:
                if documents is None:
                    output = call()
                else:
                    with documents:
                        output = call()
                    documents.verdict()
            self.learn_output(output)
            return output

        return watched

    def learn_output(self, output: Any) -> None:
        """Take the forms of micro-batch 0's output leaves from its probe."""
        if self.leaf_forms is not None or self._probe is None:
            return
        forms = [self._probe.form_of(leaf) for leaf in pytree.tree_leaves(output)]
        self._probe.release()  # the micro-batch's values: its graph's to keep, not the probe's
        self._probe = None
        learned = (forms, _named_loss(output))
        self._take(*learned)
        self._forms.keep(self.key, learned)

    def _take(self, forms: list[Form], named: int | None) -> None:
        self.leaf_forms = forms
        self.loss_at = _loss_leaf(forms, named, self._needs_loss)
        if self.loss_at is not None:
            self.learn(forms[self.loss_at])

    def leaf_shares(self) -> dict[int, LossShares]:
        """For each output leaf reduced over the batch, its micro-batches' shares."""
        shares: dict[int, LossShares] = {}
        for k, form in enumerate(self.leaf_forms or []):
            if k == self.loss_at:
                shares[k] = self
            elif is_reduced(form):
                leaf = LossShares(self.rows, self.sources, what=f"output leaf {k}")
                leaf.per_micro_batch = self.per_micro_batch
                if self.whole is not None:
                    leaf.covering(*self.whole)
                leaf.learn(form)
                shares[k] = leaf
        return shares

    # -- the loss ----------------------------------------------------------------------------
    def head(self, output: Any, i: int) -> Tensor:
        if self.loss_at is None:
            raise TypeError(
                f"the model returned {type(output).__name__} with no loss (no value reduced over "
                "the batch); pass what the model computes its loss from (e.g. labels= or "
                "targets=), or step(..., loss_fn=fn, target=y)"
            )
        loss = pytree.tree_leaves(output)[self.loss_at]
        if self.weight(i) == 0:
            return nothing(output)
        return scalar_loss(loss, "the model")


Shares = LossShares


def _named(model: nn.Module, call: Call, batch: set[int]) -> list[tuple[str, Tensor]]:
    """The tensors of the arguments ``call`` passes whole (not in ``batch``), by name."""
    keys = argument_keys(model, call.args, call.kwargs)
    return [
        (str(key), t)
        for key, value in zip(keys, [*call.args, *call.kwargs.values()])
        for t in pytree.tree_leaves(value)
        if isinstance(t, Tensor) and id(t) not in batch
    ]


"""How a step's micro-batch losses are joined: by a ``loss_fn``'s form, or the model's own."""


def _loss_leaf(forms: list[Form], named: int | None, needed: bool) -> int | None:
    """The output leaf that is the loss: the one leaf reduced over the batch, or among several
    the one the output calls ``loss`` (a mixture of experts' ``aux_loss`` beside it)."""
    reduced = [k for k, f in enumerate(forms) if is_reduced(f)]
    if len(reduced) > 1 and named in reduced:
        return named
    if len(reduced) == 1 or (reduced and not needed):
        return reduced[0]
    if len(reduced) > 1:
        raise LossNotJoinable(
            f"the model returned {len(reduced)} values reduced over the batch (output leaves "
            f"{reduced}) and pipe.step needs one loss; return one, or return the outputs and "
            "pass step(..., loss_fn=fn, target=y)"
        )
    return None


def _named_loss(output: Any) -> int | None:
    """The index of the output leaf whose key is ``loss`` (``out.loss``, ``out["loss"]``)."""
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path(output)[0]]
    except Exception:  # a container pytree cannot name: no name to go by
        return None
    named = [k for k, path in enumerate(paths) if path and _key(path[-1]) == "loss"]
    return named[0] if len(named) == 1 else None


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "name", None))


Learned = tuple[list[Form], "int | None"]
"""Per kind of call: each output leaf's form, and which leaf the output calls its loss."""


def watcher(
    shares: Shares | None, model: nn.Module, calls: Sequence[Call], forms: Forms
) -> ModelLoss | None:
    """What watches micro-batch 0's call of a kind of call: ``shares`` where it is the model's
    own outputs (it learns the loss there); for a step with a ``loss_fn``, a
    :class:`ModelLoss` that learns the outputs' forms only, so that an operation of the model
    mixing the batch's rows stops the step, before any gradient, as it stops ``pipe(...)``."""
    if isinstance(shares, ModelLoss):
        return shares
    return ModelLoss(model, calls, forms, loss=False) if calls else None


def callers(
    model: nn.Module, calls: Sequence[Call], watch: ModelLoss | None
) -> list[Callable[[], Any]]:
    """Each micro-batch's call of the model; micro-batch 0's under ``watch``'s probe while
    the outputs of its kind are still to be learned (see :func:`watcher`)."""

    def caller(i: int, c: Call) -> Callable[[], Any]:
        call = lambda: model(*c.args, **c.kwargs)  # noqa: E731
        return watch.watch(i, call) if watch is not None else call

    return [caller(i, c) for i, c in enumerate(calls)]
