"""How the losses of the micro-batches make the loss of the whole batch.

A pipe computes ``loss_fn(output_i, target_i)`` on each micro-batch ``i`` and starts that
micro-batch's backward from it, scaled by its *share*; the batch's loss is the sum of the
shares times the micro-batch losses. The shares must make that sum equal the loss the plain
model computes on the whole batch, and every gradient with it, so they depend on what the loss
divides by, which is learned from the loss's own operations (:mod:`pipepar.core.reductions`)
while micro-batch 0's loss is computed:

* a **sum** over the batch (``reduction="sum"``, ``.sum()``, a division by a number the caller
  passes): every share is 1;
* a **mean** over a count of the batch (rows, elements, the real targets of ``F.cross_entropy``
  with ``ignore_index`` and class weights, a mask's sum, ``x.size(0)``): micro-batch ``i``'s
  share is its count ``c_i`` over the batch's ``C``; its count is recomputed from its own
  target by replaying the operations that made it, so every share is known as soon as micro-
  batch 0's loss is (a micro-batch with ``c_i = 0`` adds exactly nothing, not ``0 / 0``);
* anything else (a product of two means, a ``log`` of one, means over different counts added)
  cannot be joined by shares: :class:`LossNotJoinable`, at micro-batch 0, before any backward.

A cut that may split what the loss counts (between packed documents, where the plain model's
label shift makes a document's last token predict the next one's first) gives the shares the
whole batch's inputs too (:meth:`LossShares.covering`): the micro-batches' counts must add up to
the count replayed on the whole batch, else the step is refused; a sum there is refused (what it
adds up cannot be counted).

A custom loss that averages over something only the caller knows says so with
``items=lambda target: count``: shares ``c_i / C`` from it, nothing learned.

A loss scaler's scale (:mod:`pipepar.core.loss_scale`) multiplies the seeds, not the shares:
micro-batch ``i``'s backward starts from ``share_i * scale`` (:attr:`LossShares.seeds`, read
when the share is, once micro-batch 0's loss is known); the joined loss stays the plain
model's unscaled loss.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from pipepar.core.forms import Averaged, Const, Count, Form, Summed, Unknown
from pipepar.core.held_tensors import held_tensors
from pipepar.core.reductions import Probe

__all__ = [
    "Items",
    "LossFn",
    "LossNotJoinable",
    "LossShares",
    "Seeds",
    "batch_tensors",
    "loss_shares",
    "joined_loss",
    "kept_loss",
    "nothing",
    "scalar_loss",
    "split_target",
    "weighted_sum",
]

LossFn = Callable[[Any, Any], Tensor]
"""``loss_fn(output, target) -> scalar tensor``."""

Items = Callable[[Any], "int | Tensor"]
"""``items(target) -> how many items a micro-batch's loss averages over``."""

Globalize = Callable[[float], float]
"""A replica's count made the count of every replica together (an all-reduce)."""


class LossNotJoinable(ValueError):
    """A loss whose micro-batch values cannot be joined into the whole batch's by shares.

    Example:
        >>> log_mse = lambda out, y: torch.log(F.mse_loss(out, y))  # a log of a mean
        >>> pipe.step(x, y, log_mse)  # doctest: +SKIP
        Traceback (most recent call last):
        pipepar.core.losses.LossNotJoinable: loss_fn's value cannot be joined over micro-batches...
    """


class LossShares(Sequence[float]):
    """Each micro-batch's share of the batch's loss: a sequence of floats, each known once
    micro-batch 0's loss has been computed (learned then, see the module docstring).

    Args:
        rows: each micro-batch's rows.
        sources: each micro-batch's tensors that hold its rows (what counts are replayed on).
        counts: each micro-batch's count, when known beforehand (``items=``).
        what: what computes the loss, for messages.
    """

    def __init__(
        self,
        rows: Sequence[int],
        sources: Sequence[Sequence[Tensor]],
        *,
        counts: Sequence[float] | None = None,
        what: str = "loss_fn",
    ) -> None:
        self.rows, self.sources, self.what = list(rows), [list(s) for s in sources], what
        self.ragged = _ragged(self.sources)
        """The micro-batches differ in shape beyond their rows (e.g. sequence lengths)."""
        self.counts: list[float] | None = list(counts) if counts is not None else None
        self.summed = False
        self.known = counts is not None
        self.total: float | None = float(sum(self.counts)) if self.counts is not None else None
        self._replicas = 1
        self._globalize: Globalize | None = None
        self.per_micro_batch = False
        """Join what cannot be joined exactly by rows (micro-batch semantics asked for)."""
        self.scale = 1.0
        """A loss scaler's scale: the backward seeds are the shares times it."""
        self.whole: tuple[list[Tensor], int] | None = None
        """The whole batch's inputs and size, when the cut must be checked against them."""

    def covering(self, sources: Sequence[Tensor], rows: int) -> LossShares:
        """Check the cut against the whole batch: its inputs ``sources`` (in the order of each
        micro-batch's) and its size ``rows``. The micro-batches' counts must add up to the
        whole batch's (nothing the loss counts lies across a cut)."""
        self.whole = (list(sources), rows)
        return self

    # -- learning ---------------------------------------------------------------------------
    def learn(self, form: Form) -> None:
        """Take the loss's form, as micro-batch 0's operations showed it."""
        if self.known:
            return
        if isinstance(form, Unknown) and not self.per_micro_batch:
            raise LossNotJoinable(_not_joinable(self.what, form))
        if isinstance(form, Unknown):
            form = Const()  # each micro-batch's value, weighted by its rows
        if isinstance(form, Summed):
            self._check_sum(form)
            self.summed = True
        elif isinstance(form, Averaged):
            self.counts = [self._count_of(form, i) for i in range(len(self.rows))]
            self._check_cover(form.count, self.counts, "averages")
        elif isinstance(form, Const):
            self.counts = [float(r) for r in self.rows]  # the same value: counted once
        else:
            raise LossNotJoinable(
                f"{self.what} returned one value that no operation it ran reduced over the "
                "batch: a per-row value of a one-row micro-batch, or a value the model reduced "
                "before it, whose divisor pipepar cannot see; reduce per-row values in "
                f"{self.what} (e.g. .mean()), or say what the value averages over with "
                "items=lambda target: count"
            )
        self.known = True
        self.total = float(sum(self.counts)) if self.counts is not None else None
        self._spread()

    def _count_of(self, form: Averaged, i: int) -> float:
        count = form.count
        if not count.any_rows and self.rows[i] != self.rows[0]:
            raise LossNotJoinable(
                f"{self.what} divides by {count.what}, a size of a value the model computes that "
                f"is known for micro-batches of {self.rows[0]} rows only, but micro-batch {i} has "
                f"{self.rows[i]}; give a batch that chunks divides evenly, or say what the loss "
                "averages over with items=lambda target: count"
            )
        if count.measured and self.ragged:
            raise LossNotJoinable(
                f"{self.what} divides by {count.what} in a way known for micro-batches of "
                "micro-batch 0's shape only (a count measured on it and scaled by rows, or "
                "means over different counts added), but the micro-batches differ in shape "
                f"beyond their rows ({_shapes(self.sources)}); reduce with an operation "
                "on the inputs (e.g. F.mse_loss(output, target), F.cross_entropy with "
                "ignore_index, or a sum divided by a mask's sum), or say what the loss "
                "averages over with items=lambda target: count"
            )
        return count(self.sources[i], self.rows[i])

    def _check_cover(self, count: Count, counts: Sequence[float], verb: str) -> None:
        """Under a cut checked against the whole batch: the micro-batches' ``counts`` add up
        to the whole batch's ``count``."""
        if self.whole is None:
            return
        whole = count(*self.whole)
        if abs(whole - sum(counts)) > 1e-6 * max(1.0, abs(whole)):
            raise LossNotJoinable(
                f"{self.what} {verb} over {count.what}: {whole:g} of them in the whole batch, "
                f"but {sum(counts):g} in its micro-batches together "
                f"({[round(c, 6) for c in counts]}): something it counts lies across a cut "
                "between documents (the plain model's shifted labels make a document's last "
                "token predict the next document's first one); mark each document's first "
                "label ignored (-100, as DataCollatorWithFlattening does), or use chunks=1"
            )

    def _check_sum(self, form: Summed) -> None:
        if self.whole is None:
            return
        if form.items is None:
            raise LossNotJoinable(
                f"{self.what} is a sum over the batch, cut here between documents, of terms "
                "pipepar cannot count, so it cannot check that none lies across a cut (a "
                "document's last token predicting the next one's first); sum a class loss "
                "(F.cross_entropy with ignore_index) or average, or use chunks=1"
            )
        items = form.items
        self._check_cover(items, [items(s, r) for s, r in zip(self.sources, self.rows)], "sums")

    def learning(self) -> bool:
        """Whether micro-batch 0's loss has yet to show its form."""
        return not self.known

    # -- spread over replicas -------------------------------------------------------------
    def spread(self, globalize: Globalize | None, replicas: int) -> LossShares:
        """These shares as one of ``replicas`` data-parallel batches whose gradients are
        averaged: ``globalize`` makes this batch's count the count of them all (applied once
        the count is known); a summed loss is summed over the replicas."""
        self._replicas, self._globalize = replicas, globalize
        if self.known:
            self._spread()
        return self

    def _spread(self) -> None:
        if self._globalize is not None and self.total is not None:
            self.total = self._globalize(self.total)
            self._globalize = None

    # -- the shares -------------------------------------------------------------------------
    @property
    def weights(self) -> LossShares:
        """The shares: this sequence itself."""
        return self

    def scaled(self, scale: float) -> LossShares:
        """These shares with their backward seeds multiplied by ``scale`` (a loss scaler's)."""
        self.scale = scale
        return self

    @property
    def seeds(self) -> Seeds:
        """The gradient each micro-batch's backward starts from: its share times the scale,
        each read when asked (known once micro-batch 0's loss is)."""
        return Seeds(self)

    def weight(self, i: int) -> float:
        if not self.known:
            raise RuntimeError(
                f"the share of micro-batch {i} was read before {self.what}'s form was learned"
            )
        if self.summed or self.counts is None:
            return float(self._replicas)
        return self.counts[i] / self.total * self._replicas if self.total else 0.0

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        return self.weight(i)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[float]:
        return (self.weight(i) for i in range(len(self.rows)))

    def probe(self, i: int, constants: Sequence[Tensor] = ()) -> Probe | None:
        """The probe micro-batch ``i``'s loss runs under while the form is being learned."""
        if i != 0 or self.known:
            return None
        return Probe(self.sources[0], constants, rows=self.rows[0], where=self.what)

    def head_of(self, loss_fn: LossFn, targets: Sequence[Any]) -> Callable[[Any, int], Tensor]:
        """Micro-batch ``i``'s loss ``loss_fn(output, targets[i])``, a scalar tensor (checked);
        the first one learns the shares."""

        def head(output: Any, i: int) -> Tensor:
            probe = self.probe(i, held_tensors(loss_fn) if i == 0 and not self.known else ())
            if probe is None:
                loss = scalar_loss(loss_fn(output, targets[i]), self.what)
            else:
                probe.computed_rows(_row_leaves(output, self.rows[i]))
                with probe:
                    value = loss_fn(output, targets[i])
                loss = scalar_loss(value, self.what)
                form = probe.form_of(value)
                probe.release()
                self.learn(form)
                _LEARNED.keep(loss_fn, _kind(targets[0], self.rows[0]), form)
            return nothing(output) if self.weight(i) == 0 else loss

        return head


class _LearnedForms:
    """What each loss function's value was, by kind of step (see :func:`_kind`): a step learns
    it on its first call of a kind and later ones take it at their start, each micro-batch's
    count still recomputed from its own target. Forgotten with the function."""

    def __init__(self) -> None:
        self._forms: weakref.WeakKeyDictionary[Any, dict[Hashable, Form]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(self, loss_fn: Any, kind: Hashable) -> Form | None:
        with self._lock, contextlib.suppress(TypeError):  # not weakly referable: not kept
            return self._forms.get(loss_fn, {}).get(kind)
        return None

    def keep(self, loss_fn: Any, kind: Hashable, form: Form) -> None:
        with self._lock, contextlib.suppress(TypeError):
            self._forms.setdefault(loss_fn, {})[kind] = form


_LEARNED = _LearnedForms()


def _kind(target: Any, rows: int) -> Hashable:
    """A step's kind as far as its loss goes: micro-batch 0's rows and its target's structure,
    shapes and dtypes (what a step knows before any forward: its loss's form, once learned, is
    then known at its start, and the replicas sum their counts there, before anything runs)."""
    leaves, spec = pytree.tree_flatten((rows, target))
    return (
        str(spec),
        tuple(
            (tuple(t.shape), t.dtype, t.device.type) if isinstance(t, Tensor) else repr(t)
            for t in leaves
        ),
    )


class Seeds(Sequence[float]):
    """The gradients the micro-batches' backwards start from: each share times the loss
    scale, read when asked (a share is known only once micro-batch 0's loss has been computed).

    Example:
        >>> shares = LossShares([2, 2], [[], []], counts=[1.0, 3.0]).scaled(1024.0)
        >>> list(shares.seeds)
        [256.0, 768.0]
    """

    def __init__(self, shares: LossShares) -> None:
        self._shares = shares

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        return self._shares.weight(i) * self._shares.scale

    def __len__(self) -> int:
        return len(self._shares)

    def __iter__(self) -> Iterator[float]:
        return (self[i] for i in range(len(self)))


def loss_shares(
    loss_fn: LossFn, targets: Sequence[Any], rows: Sequence[int], items: Items | None = None
) -> LossShares:
    """The shares of the micro-batch losses ``loss_fn(output_i, targets[i])`` (see the module
    docstring): learned from micro-batch 0's loss, or from ``items``.

    Args:
        loss_fn: the loss of one micro-batch.
        targets: each micro-batch's target.
        rows: each micro-batch's rows.
        items: for a custom loss that averages over a count only the caller knows:
            ``items(target_i)`` gives micro-batch ``i``'s count.

    Example:
        >>> y = torch.tensor([1, -100, -100, -100])
        >>> targets = split_target(y, [2, 2])
        >>> shares = loss_shares(torch.nn.functional.cross_entropy, targets, [2, 2])
        >>> head = shares.head_of(torch.nn.functional.cross_entropy, targets)
        >>> _ = head(torch.randn(2, 3), 0)  # micro-batch 0's loss shows what it divides by
        >>> list(shares)  # one real target in all, in micro-batch 0
        [1.0, 0.0]
    """
    sources = batch_tensors(targets)
    if items is None:
        shares = LossShares(rows, sources)
        known = _LEARNED.get(loss_fn, _kind(targets[0], rows[0])) if targets else None
        if known is not None:
            shares.learn(known)
        return shares
    if not callable(items):
        raise TypeError(
            f"items must be callable (items(target) -> count), but got {type(items).__name__}; "
            "e.g. items=lambda y: (y != -100).sum()"
        )
    return LossShares(rows, sources, counts=[float(items(t)) for t in targets])


def _row_leaves(output: Any, rows: int) -> list[Tensor]:
    """The tensors of a micro-batch's output that hold its ``rows`` on dimension 0 (the
    stage's output check holds a chain's to it; a model's others mixing rows were refused by
    its forward's probe)."""
    return [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows
    ]


def batch_tensors(values: Sequence[Any]) -> list[list[Tensor]]:
    """Each micro-batch's tensors that hold its rows: the leaves of ``values[i]`` that are not
    the same object in every micro-batch (what is passed whole to each is not of the batch)."""
    flat = [pytree.tree_leaves(v) for v in values]
    if not flat:
        return []
    whole = {
        k
        for k, leaf in enumerate(flat[0])
        if len(flat) > 1 and all(len(f) > k and f[k] is leaf for f in flat)
    }
    return [
        [
            t
            for k, t in enumerate(leaves)
            if isinstance(t, Tensor) and t.dim() > 0 and k not in whole
        ]
        for leaves in flat
    ]


def _ragged(sources: Sequence[Sequence[Tensor]]) -> bool:
    """Whether the micro-batches' tensors differ in shape beyond their rows (dimension 0)."""
    first = [t.shape[1:] for t in sources[0]] if sources else []
    return any([t.shape[1:] for t in s] != first for s in sources[1:])


def _shapes(sources: Sequence[Sequence[Tensor]]) -> str:
    shown = [[tuple(t.shape) for t in s] for s in sources[:3]]
    return f"tensors of {', '.join(map(str, shown))}{' ...' if len(sources) > 3 else ''}"


def _not_joinable(what: str, form: Unknown) -> str:
    return (
        f"{what}'s value cannot be joined over micro-batches: {form.op} in {form.where} makes it, "
        f"and {form.why}. pipepar joins a loss that is a sum over the batch or a mean over a "
        "count of it; compute such a loss, or say what it averages over with "
        "items=lambda target: count, or use chunks=1"
    )


def weighted_sum(values: Sequence[Tensor], shares: Sequence[float]) -> Tensor:
    """``sum(share * value)`` over the micro-batches whose share is not 0 (a value there may be
    ``nan``: a mean over nothing)."""
    terms = [v * w for v, w in zip(values, shares) if w != 0]
    return sum(terms[1:], terms[0]) if terms else torch.zeros_like(values[0])


def kept_loss(value: Any) -> Any:
    """A micro-batch's loss as a step keeps it until the mini-batch's end: detached, each tensor
    in a storage of its own size. torch's element-wise losses (``mse_loss``, ``l1_loss``,
    ``smooth_l1_loss``, ...) reduce into a scalar that still holds the whole element-wise
    buffer, a micro-batch's output in bytes; kept as they are, the last stage held one such
    buffer per micro-batch until the step ended."""
    if isinstance(value, Tensor):  # the usual loss: no tree to walk
        return _own_storage(value)
    return pytree.tree_map_only(Tensor, _own_storage, value)


def _own_storage(t: Tensor) -> Tensor:
    t = t.detach()
    if t.layout == torch.strided and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def joined_loss(values: Sequence[Any], shares: Sequence[float]) -> Tensor:
    """The batch's loss: each micro-batch's loss value (a one-element tensor or a number, as
    the last stage returned it) times its share, as a detached scalar in float32 or, for a
    loss in float64, in float64 (as precise as the plain model's)."""
    losses = [_at_least_float32(torch.as_tensor(v).reshape(()).detach()) for v in values]
    return weighted_sum(losses, shares)


def _at_least_float32(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


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
