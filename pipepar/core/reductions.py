"""What a call's values are, learned from its operations: :class:`Probe`.

A torch-function mode watches one micro-batch's call and gives every value a
:data:`~pipepar.core.forms.Form`: per-row values, constants, or values reduced over the batch
and what they divide by (``F.cross_entropy(..., ignore_index=-1)`` by its real targets,
``reduction="sum"`` by nothing, ``(l * mask).sum() / mask.sum()`` by a count of the batch,
``l.sum() / x.size(0)`` by the micro-batch's rows, ``l.sum() / n`` by a number the caller
passes). A count that depends only on the call's inputs is kept as the operations that made
it, replayed on any micro-batch's inputs, so the counts of every micro-batch are known as soon
as one micro-batch has been watched, before the others' forwards run. A count that is a size
of something the model computes is known per row (its first dimension a multiple of the
micro-batch's rows) or for micro-batches of the watched one's shape only.

An operation that mixes rows is refused where it runs, except one that repeats or drops them
(``x.repeat(2, 1)``, ``x[1:]``): what a stage returns is checked for its rows by the stage
(:func:`~pipepar.core.microbatch.check_rows` names its last layer), so such a result is refused
when the call ends, unless an error (that check's) came first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipepar.core.batch_dims import Coupling, batch_dim_after, reduced_dims
from pipepar.core.batch_outcome import resized
from pipepar.core.forms import (
    ADDITIVE,
    SCALING,
    Averaged,
    Const,
    Count,
    Form,
    Number,
    Ref,
    Replay,
    Rows,
    Source,
    Summed,
    Unknown,
    arithmetic,
    form_of_number,
    is_reduced,
    number,
    op_name,
    replayed,
)
from pipepar.core.keyword_operands import positional
from pipepar.core.whole_inputs import SCATTERS, WholeInputs

__all__ = ["BatchCoupled", "Probe"]


class BatchCoupled(ValueError):
    """An operation that mixes rows of the batch, which micro-batches would compute on their
    own rows only: refused at the first call, before any gradient.

    Example:
        >>> class Centered(nn.Module):
        ...     def forward(self, x):
        ...         return x - x.mean(0)  # a mean over the rows of the batch
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Centered())
        >>> pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=2)
        >>> pipe(torch.randn(4, 8))  # doctest: +SKIP
        Traceback (most recent call last):
        pipepar.core.reductions.BatchCoupled: mean() in module layer 3 mixes rows of the batch...
    """


def _coupled(coupling: Coupling, where: str) -> str:
    mixes = "mixes" if coupling.certain else "may mix"
    return (
        f"{coupling.op}() in {where} {mixes} rows of the batch: {coupling.why}. Split into "
        "micro-batches, each would compute it on its own rows only, and the result would not "
        "be the plain model's. Ways out: chunks=1 (no micro-batches); deferred_batch_norm=True "
        "for batch norm (statistics per micro-batch, running statistics over the batch); or "
        "batch_coupling='per-micro-batch' to accept that each micro-batch computes it on its "
        "own rows (what Megatron does for mixture-of-experts auxiliary losses)"
    )


# -- the module a value is computed in, for messages ------------------------------------------
_local = threading.local()


def _module_stack() -> list[str]:
    stack: list[str] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def _tracking_modules(names: dict[int, str]) -> Iterator[None]:
    """Keep this thread's stack of the modules whose forward runs (by path), while probing."""

    def before(module: nn.Module, args: Any) -> None:
        if getattr(_local, "probing", 0):
            _module_stack().append(names.get(id(module), type(module).__name__))

    def after(module: nn.Module, args: Any, output: Any) -> None:
        stack = _module_stack()
        if getattr(_local, "probing", 0) and stack:
            stack.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(before),
        nn.modules.module.register_module_forward_hook(after, always_call=True),
    ]
    _local.probing = getattr(_local, "probing", 0) + 1
    try:
        yield
    finally:
        _local.probing -= 1
        if not _local.probing:
            _module_stack().clear()
        for hook in hooks:
            hook.remove()


def _where(default: str) -> str:
    stack = _module_stack()
    return f"module {stack[-1]}" if stack and stack[-1] else default


# -- the probe ---------------------------------------------------------------------------------
class Probe(TorchFunctionMode):
    """Watches one micro-batch's call and learns the :data:`Form` of every value it makes.

    Args:
        sources: the call's tensors that hold the batch's rows (split into micro-batches);
            after the first ``tracked``, tensors that hold the micro-batch's part of the batch
            otherwise (packed items: its counts are replayed on them, its rows are not
            followed through them).
        constants: tensors that do not depend on the batch (weights and buffers, arguments
            passed whole to every micro-batch).
        rows: the micro-batch's rows (its size on the cut's dimension: its tokens when a
            batch of packed documents is cut between them).
        rows_dim: where a value the probe does not follow has the cut's units: dimension 0
            (rows), or 1 (the tokens of a one-row batch cut between documents).
        names: module paths by ``id``, for messages.
        where: what the call is, for messages about operations outside any module.
        resolve: for a tensor the probe did not see made (a stage's leaf standing for another
            stage's value), the value it stands for.
        accepts: whether an operation that mixes rows of the batch is accepted (computed per
            micro-batch on purpose); any other raises :class:`BatchCoupled`.
        whole: the arguments passed whole to every one of several micro-batches, by name:
            filling the rows with their items in order raises :class:`BatchCoupled`
            (:mod:`pipepar.core.whole_inputs`).

    Example:
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, -1, 2])
        >>> with Probe([x, y], rows=4) as probe:
        ...     loss = F.cross_entropy(x, y, ignore_index=-1)
        >>> probe.form_of(loss).count.of([x, y], 4)  # three real targets
        3.0
    """

    def __init__(
        self,
        sources: Sequence[Tensor],
        constants: Sequence[Tensor] = (),
        *,
        rows: int,
        names: dict[int, str] | None = None,
        where: str = "the model's forward",
        resolve: Callable[[Tensor], Tensor | None] | None = None,
        accepts: Callable[[Coupling], bool] = lambda coupling: False,
        tracked: int | None = None,
        rows_dim: int = 0,
        whole: Sequence[tuple[str, Tensor]] = (),
    ) -> None:
        super().__init__()
        self._whole = WholeInputs(whole)
        self._counted: Coupling | None = None
        self._resize: str | None = None
        self._accepts = accepts
        self.rows, self._rows_dim = rows, rows_dim
        self._forms: dict[int, tuple[Any, Form]] = {}
        self._constants = {id(t) for t in constants}
        self._names = names or {}
        self._default_where = where
        self._resolve = resolve
        self._modules = contextlib.ExitStack()
        rows_of = len(sources) if tracked is None else tracked
        for k, t in enumerate(sources):
            self._set(t, Rows(Source(k), 0 if k < rows_of else None))

    def __enter__(self) -> Probe:
        self._modules.enter_context(_tracking_modules(self._names))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._modules.close()
        if exc[0] is None and self._resize is not None:
            raise BatchCoupled(self._resize)

    def computed_rows(self, values: Sequence[Tensor]) -> None:
        """Mark ``values`` (what the model computed for the micro-batch, handed to a loss) as
        per-row values with their rows on dimension 0, not replayable from the inputs: an
        operation over those rows (``out.var(0)``, ``out - out.mean(0)``) is then refused."""
        for t in values:
            if id(t) not in self._forms:
                self._set(t, Rows(None, 0))

    def release(self) -> None:
        """Let go of the call's values (the forms learned stay with whoever asked for them)."""
        self._forms.clear()
        self._whole.release()

    def form_of(self, value: Any) -> Form:
        """The form of a value the call made or was given."""
        if isinstance(value, Number):
            return value.form
        if not isinstance(value, Tensor):
            return form_of_number(value)
        found = self._forms.get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        if id(value) in self._constants or isinstance(value, nn.Parameter):
            return _const(value)
        original = self._resolve(value) if self._resolve is not None else None
        if original is not None and original is not value:
            return self.form_of(original)
        return Rows(None)  # made where no operation of the call was seen: a value of the batch

    def _set(self, value: Any, form: Form) -> None:
        if isinstance(value, Tensor):
            self._forms[id(value)] = (value, form)
        elif isinstance(value, (tuple, list)):
            for t in value:
                self._set(t, form)

    # -- the mode -----------------------------------------------------------------------------
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        named = positional(func, args, kwargs)  # read by position however the call spells it
        if self._whole and op_name(func) in SCATTERS:  # before it runs: it may fail on them
            self._refuse_scatter(op_name(func), *named)
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return self._learn(func, *named, out)

    def _refuse_scatter(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        def of_rows(value: Any) -> bool:
            return isinstance(self.form_of(value), Rows)

        refused = self._whole.refusal(name, args, kwargs, of_rows, _where(self._default_where))
        if refused:
            raise BatchCoupled(refused)

    def _learn(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        name = op_name(func)
        operands = [v for v in _operands(args, kwargs) if _is_operand(v)]
        if name not in ADDITIVE | SCALING:  # a size given as a shape, a split, a dim...
            operands = [v for v in operands if isinstance(v, Tensor)]
        forms = [self.form_of(v) for v in operands]
        if self._whole:
            self._whole.follow(operands, forms, out)
        if all(isinstance(f, Const) for f in forms):
            if isinstance(out, Tensor):
                self._set(out, _const(out))
            return out
        if name in _FACTORIES:  # made from sizes alone, whatever gave them (a grid's max)
            self._set(out, _const(out))
            return out
        if name in _SIZES or func is _SHAPE:
            return self._size(name, operands[0], forms[0], out, args)
        if any(is_reduced(f) for f in forms):
            form = arithmetic(name, forms, _where(self._default_where))
            self._set(out, form)
            return number(out, form)
        if name == "setitem":
            self._written(func, args, kwargs, operands, forms)
            return out
        if not isinstance(out, (Tensor, tuple, list)):
            return out  # a number read off per-row values
        reduced = self._reduction(func, name, args, kwargs, operands, forms, out)
        if reduced is not None:
            self._set(out, reduced)
            return out
        replay = self._replay(func, args, kwargs, forms)
        self._counted = None
        dim = self._batch_dim(name, func, args, kwargs, out, operands, forms)
        mixed = self._mixed(name, args, out, operands, forms)
        if isinstance(out, (tuple, list)) and (replay is not None or isinstance(dim, tuple)):
            for k, part in enumerate(out):  # each part replays as its item of the whole
                again = Replay(operator.getitem, (Ref(replay), k), {}) if replay else None
                self._set(part, Rows(again, _part(dim, k), mixed))
        else:
            self._set(out, Rows(replay, _part(dim, 0), mixed))
        return out

    def _mixed(
        self, name: str, args: tuple[Any, ...], out: Any, operands: list[Any], forms: list[Form]
    ) -> Coupling | None:
        """The reduction over the rows that made an operand a count of the batch (or the one
        just let through); refused when the result is floating-point: the count reaches the
        numbers. A count used as an index routes (a mixture of experts picks the experts the
        batch hits): trusted, unless it picks among a value of the batch's own floats
        (``x[:, mask.all(0)]``)."""
        table = _TABLES.get(name)
        if table is not None and len(args) > table and isinstance(args[table], Tensor):
            of_rows = self.form_of(args[table])
            per_row = isinstance(of_rows, Rows) and of_rows.dim is not None
            keep = [(v, f) for v, f in zip(operands, forms) if v is args[table]]
            if per_row and _floating(args[table]):
                keep = list(zip(operands, forms))
            forms = [f for _, f in keep]
        inherited = (f.mixed for f in forms if isinstance(f, Rows) and f.mixed is not None)
        mixed = self._counted or next(inherited, None)
        if mixed is not None and _floating(out) and not self._accepts(mixed):
            where = _where(self._default_where)
            raise BatchCoupled(
                _coupled(mixed, where) + f"; its integer result reaches floating-point values "
                f"in {name}()"
            )
        return mixed

    def _written(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        operands: list[Any],
        forms: list[Form],
    ) -> None:
        """``x[index] = value``: refused where it writes rows by their position; ``x`` holds
        rows where ``value`` put them."""
        target = args[0]
        self._counted = None
        dim = self._batch_dim("setitem", func, args, kwargs, target, operands, forms)
        self._mixed("setitem", args, target, operands, forms)
        if isinstance(self.form_of(target), Const) and any(isinstance(f, Rows) for f in forms):
            self._set(target, Rows(None, _part(dim, 0)))

    def _batch_dim(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        operands: list[Any],
        forms: list[Form],
    ) -> int | tuple[int | None, ...] | None:
        """Where the rows are in ``out`` (in each of its parts); an operation mixing them is
        refused here, at the first call, unless accepted."""
        rows = [(v, f.dim) for v, f in zip(operands, forms) if isinstance(f, Rows)]
        batched = [(v, d) for v, d in rows if d is not None and isinstance(v, Tensor)]
        loose = [v for v, d in rows if d is None and isinstance(v, Tensor)]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if not batched or not isinstance(first, Tensor) or self.rows < 2:
            return None
        outcome = batch_dim_after(name, func, args, kwargs, first, batched, loose)
        if not isinstance(outcome, Coupling):
            return outcome
        if self._accepts(outcome):
            return None
        if not any(t.is_floating_point() for t, _ in batched):  # an index or a count (routing)
            self._counted = outcome if outcome.reduces else None
            return None
        refused = _coupled(outcome, _where(self._default_where))
        sizes = resized(outcome, first, batched)
        if sizes is None:
            raise BatchCoupled(refused)
        # Rows repeated or dropped: a stage output holding them is the stage's check's to
        # name (check_rows: its last layer, the shapes); one that stays inside is refused
        # when the call ends (__exit__).
        held = f"; its result holds {sizes[1]} rows where its operand had {sizes[0]}"
        self._resize = self._resize or refused + held
        return None

    def _replay(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        forms: list[Form],
    ) -> Replay | None:
        """How to recompute an operation's result from the inputs, when every batch value it
        takes can be recomputed so."""
        if not all(isinstance(f, Const) or (isinstance(f, Rows) and f.replay) for f in forms):
            return None

        def template(value: Any) -> Any:
            if isinstance(value, Tensor):
                form = self.form_of(value)
                return Ref(form.replay) if isinstance(form, Rows) and form.replay else value
            if isinstance(value, (list, tuple)):
                return type(value)(template(v) for v in value)
            return value

        if op_name(func) in _MOVES:  # counts are taken where the inputs are (meta on a shadow)
            func = _cast_only
        return Replay(func, template(args), {k: template(v) for k, v in kwargs.items()})

    # -- sizes --------------------------------------------------------------------------------
    def _size(self, name: str, tensor: Any, form: Form, out: Any, args: tuple[Any, ...]) -> Any:
        """A size read off a value of the batch: its first dimension counts the batch (when a
        multiple of the micro-batch's rows), the others are constants."""
        if not isinstance(tensor, Tensor) or not isinstance(form, Rows) or tensor.dim() == 0:
            return out
        if isinstance(out, torch.Size):
            return torch.Size([self._dim_size(tensor, form, d) for d in range(len(out))])
        if name == "numel":
            return number(out, Summed(self._count(tensor, form, lambda t: t.numel(), "elements")))
        dim = args[1] if len(args) > 1 else 0
        if isinstance(out, int) and isinstance(dim, int):
            return self._dim_size(tensor, form, dim % tensor.dim())
        return out

    def _dim_size(self, tensor: Tensor, form: Form, d: int) -> Any:
        """Size ``d`` of a value of the batch: a count of it where the rows are (the first
        dimension, a multiple of the rows, when not known), else a constant."""
        n = tensor.shape[d]
        rows_dim = form.dim if isinstance(form, Rows) and form.dim is not None else self._rows_dim
        if d != rows_dim or self.rows == 0 or n % self.rows:
            return n
        return number(n, Summed(self._count(tensor, form, lambda t: t.shape[d], "rows")))

    def _count(
        self, tensor: Tensor, form: Form, measure: Callable[[Tensor], int], what: str
    ) -> Count:
        """``measure`` (a number of elements or rows: a fixed number per row where the rows are
        known) of a value of the batch, for any micro-batch: recomputed from the inputs, or
        scaled by rows when the value's rows dimension is a multiple of them."""
        dim = form.dim if isinstance(form, Rows) and form.dim is not None else None
        if isinstance(form, Rows) and form.replay is not None:
            count = replayed(form.replay, measure, f"the {what} of an input")
            return dataclasses.replace(count, per_row=dim is not None)
        value = float(measure(tensor))
        label = f"the {what} of a {tuple(tensor.shape)} value"
        at = self._rows_dim if dim is None else dim
        if self.rows and tensor.dim() > at and tensor.shape[at] % self.rows == 0:
            per_row = value / self.rows
            measured = what != "rows"  # a size of another dimension: the watched one's
            return Count(lambda s, r: per_row * r, label, per_row=True, measured=measured)
        return Count(lambda s, r: value, label, any_rows=False, fixed=value, measured=True)

    # -- reductions over the batch ------------------------------------------------------------
    def _reduction(
        self,
        func: Callable[..., Any],
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        operands: list[Any],
        forms: list[Form],
        out: Any,
    ) -> Form | None:
        """The form of ``out`` if the operation reduces a value of the batch to one number (or
        to several: ``var_mean``, ``aminmax``)."""
        first = operands[0] if operands else None
        if _several_numbers(out) and name in _OTHER_REDUCTIONS and _holds_rows(first):
            return Unknown(f"{name}()", _where(self._default_where), "it reduces the batch")
        if not isinstance(out, Tensor) or out.dim() != 0 or not isinstance(first, Tensor):
            return None
        if first.dim() == 0:
            return None  # an element-wise operation on one value
        where = _where(self._default_where)
        replay = self._replay(func, args, kwargs, forms)
        if name in ("sum", "nansum", "count_nonzero"):
            return Summed(replayed(replay, lambda t: t, "a sum of the inputs") if replay else None)
        if name in ("mean", "nanmean") and _all_dims(args, kwargs):
            return Averaged(self._count(first, forms[0], lambda t: t.numel(), "elements"))
        if _LOSSES.get(name) is func:
            return self._loss(func, args, kwargs, where)
        if name in _OTHER_REDUCTIONS:
            return Unknown(f"{name}()", where, "it reduces the batch to one value")
        return None  # one element picked or computed from per-row values: still per-row

    def _loss(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], where: str
    ) -> Form:
        bound = _bind(func, args, kwargs)
        reduction = bound.get("reduction", "mean")
        name = func.__name__
        if reduction == "sum":
            classes = name in ("cross_entropy", "nll_loss")
            return Summed(items=self._real_targets(bound, name) if classes else None)
        if name in ("cross_entropy", "nll_loss"):
            return self._class_loss(bound, name, where)
        if name == "kl_div" and reduction == "batchmean":
            return Averaged(self._count(bound["input"], Rows(), lambda t: t.shape[0], "rows"))
        if name == "ctc_loss":
            return Unknown(f"F.{name}()", where, "its mean divides each sequence by its length")
        elementwise = _elementwise(func, bound)
        if elementwise is None:
            return Unknown(f"F.{name}()", where, "its elements could not be told from its shapes")
        target = bound.get("target")
        if isinstance(target, Tensor) and elementwise.shape == target.shape:
            return Averaged(
                self._count(target, self.form_of(target), lambda t: t.numel(), "elements")
            )
        return Averaged(self._count(elementwise, Rows(), lambda t: t.numel(), "elements"))

    def _class_loss(self, bound: dict[str, Any], name: str, where: str) -> Form:
        target = bound["target"]
        form = self.form_of(target)
        if target.is_floating_point():  # class probabilities: a mean over the rows
            classes = bound["input"].shape[1] if bound["input"].dim() > 1 else 1
            return Averaged(self._count(target, form, lambda t: t.numel() // classes, "rows"))
        real = self._real_targets(bound, name)
        if real is not None:
            return Averaged(real)
        if isinstance(form, Const):  # made from sizes alone (torch.arange(len(logits)))
            value = float(_real_targets(target, bound))
            label = f"the targets of F.{name}()"
            count = Count(lambda s, r: value, label, any_rows=False, fixed=value, measured=True)
            return Averaged(count)
        return Unknown(
            f"F.{name}()",
            where,
            "its targets are computed by the model, so the count of real targets it divides by "
            "is not known before each micro-batch's forward",
        )

    def _real_targets(self, bound: dict[str, Any], name: str) -> Count | None:
        """The count of a class loss's real targets in any micro-batch, when its class-index
        target is replayed from the inputs."""
        target = bound["target"]
        form = self.form_of(target)
        if target.is_floating_point() or not isinstance(form, Rows) or form.replay is None:
            return None
        replay = form.replay
        return Count(
            lambda sources, rows: float(_real_targets(replay(sources, {}), bound)),
            f"the real targets of F.{name}()",
        )


_MOVES = {"to", "cuda", "cpu"}
_TABLES = {
    **dict.fromkeys(("getitem", "setitem", "index_put", "index_select", "gather"), 0),
    **dict.fromkeys(("take_along_dim", "index_add", "index_copy", "index_fill", "scatter"), 0),
    **dict.fromkeys(("scatter_add", "scatter_reduce", "masked_select", "masked_scatter"), 0),
    "embedding": 1,
}
"""Operations that look up a table (by its position among the arguments) at indices."""


def _several_numbers(out: Any) -> bool:
    """A tuple of one-element results (``var_mean``, ``aminmax`` over every element)."""
    parts = out if isinstance(out, (tuple, list)) else ()
    return bool(parts) and all(isinstance(t, Tensor) and t.dim() == 0 for t in parts)


def _holds_rows(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def _floating(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_floating(v) for v in value)
    return isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())


def _part(dim: int | tuple[int | None, ...] | None, k: int) -> int | None:
    """The rows' dimension in part ``k`` of a result (the last one given for the rest)."""
    if isinstance(dim, tuple):
        return dim[min(k, len(dim) - 1)] if dim else None
    return dim


def _cast_only(t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``t.to(...)`` keeping its device: only a dtype among the arguments is applied."""
    dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    if dtype is None:
        other = next((a for a in args if isinstance(a, Tensor)), None)
        dtype = other.dtype if other is not None else None
    return t if dtype is None else t.to(dtype)


def _const(t: Tensor) -> Const:
    if t.numel() == 1 and t.device.type != "meta":
        return Const(float(t.detach().reshape(()).item()))
    return Const()


def _real_targets(target: Tensor, bound: dict[str, Any]) -> Tensor:
    """The count (or the class weights' sum) of the targets a cross-entropy does not ignore."""
    real = target != bound.get("ignore_index", -100)
    weight = bound.get("weight")
    if weight is None:
        return real.sum()
    return (weight.to(target.device)[target.clamp(0, len(weight) - 1)] * real).sum()


def _elementwise(func: Callable[..., Any], bound: dict[str, Any]) -> Tensor | None:
    """What a loss's elements look like (a meta tensor of their shape): the loss run on meta
    with ``reduction="none"``, or, for one that reads its arguments' values there
    (``F.gaussian_nll_loss`` checks its variances), its input and target broadcast."""
    try:
        out: Tensor = func(**{**_shapes_only(bound), "reduction": "none"})
        return out
    except (RuntimeError, NotImplementedError):
        shapes = [bound[k].shape for k in ("input", "target") if isinstance(bound.get(k), Tensor)]
        if not shapes:
            return None
        return torch.empty(torch.broadcast_shapes(*shapes), device="meta")


def _shapes_only(bound: dict[str, Any]) -> dict[str, Any]:
    """``bound``'s tensors as meta tensors of their shapes: what a loss's elements look like,
    computed on no device (a shadow stage's meta output and the caller's target are on two)."""
    return {
        k: torch.empty_like(v, device="meta") if isinstance(v, Tensor) else v
        for k, v in bound.items()
    }


def _bind(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A torch loss's arguments by name, its legacy ``size_average``/``reduce`` as ``reduction``."""
    values = dict(inspect.signature(func).bind(*args, **kwargs).arguments)
    legacy = values.pop("size_average", None), values.pop("reduce", None)
    if legacy != (None, None):
        values["reduction"] = torch.nn._reduction.legacy_get_string(*legacy)
    return values


def _all_dims(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dims = reduced_dims(args, kwargs, args[0].dim())
    return dims is None or dims == set(range(args[0].dim()))


def _is_operand(value: Any) -> bool:
    return isinstance(value, (Tensor, int, float)) and not isinstance(value, bool)


def _operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


_FACTORIES = {"arange", "zeros", "ones", "empty", "eye", "randperm", "new_zeros", "new_ones"}
_FACTORIES |= {"new_empty", "new_full", "new_tensor"}
"""Operations whose tensor operands are sizes: what they make holds no value of the batch."""
_SHAPE = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
_SIZES = {"size", "numel", "len"}
_OTHER_REDUCTIONS = {
    "amax",
    "amin",
    "max",
    "min",
    "logsumexp",
    "norm",
    "std",
    "var",
    "prod",
    "median",
    "nanmedian",
    "quantile",
    "nanquantile",
    "dist",
    "cdist",
    "var_mean",
    "std_mean",
    "aminmax",
    "linalg_norm",
    "vector_norm",
    "matrix_norm",
    "frobenius_norm",
    "trace",
    "dot",
    "vdot",
    "inner",
    "kthvalue",
    "mode",
}
_LOSSES: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        F.cross_entropy,
        F.nll_loss,
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.kl_div,
        F.poisson_nll_loss,
        F.gaussian_nll_loss,
        F.margin_ranking_loss,
        F.hinge_embedding_loss,
        F.multilabel_margin_loss,
        F.soft_margin_loss,
        F.multilabel_soft_margin_loss,
        F.cosine_embedding_loss,
        F.multi_margin_loss,
        F.triplet_margin_loss,
        F.ctc_loss,
    )
}
