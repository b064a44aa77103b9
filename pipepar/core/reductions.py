"""How a value computed from a batch joins over micro-batches, learned from its operations.

A pipe runs a call once per micro-batch and must join what the micro-batches return into what
the plain model returns on the whole batch. For a tensor of per-row values that is a
concatenation; for a value *reduced over the batch* (a loss) it depends on what the code
divides by, which no name tells reliably: ``F.cross_entropy(..., ignore_index=-1)`` divides a
sum by its real targets, ``reduction="sum"`` by nothing, ``(l * mask).sum() / mask.sum()`` by a
count of the batch, ``l.sum() / x.size(0)`` by the micro-batch's rows, ``l.sum() / n`` by a
number the caller passes.

:class:`Probe` is a torch-function mode that watches one micro-batch's call and gives every
value a :data:`Form`:

* :class:`Const`: does not depend on the batch (weights, numbers, a count the caller passes);
* :class:`Rows`: per-row values of the batch (inputs, activations, targets, masks);
* :class:`Summed`: a sum over the batch: the micro-batches' values add up;
* :class:`Averaged`: a sum over the batch divided by a :class:`Count` of it: the micro-batches'
  values join weighted by their counts;
* :class:`Unknown`: reduced over the batch in a way no weighting of the micro-batch values can
  join (a product of two sums, a ``log`` of a mean, a max...): the operation and the module are
  kept for the error.

A count that depends only on the call's inputs (real targets, a mask) is kept as a
:class:`Count` that recomputes it from any micro-batch's inputs (the operations that made it,
replayed), so the counts of every micro-batch are known as soon as one micro-batch has been
watched, before the others' forwards run. A count that is a size of something the model
computes is known per row (its first dimension is the micro-batch's rows) or for micro-batches
of the watched one's shape only.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "Averaged",
    "Const",
    "Count",
    "Form",
    "Probe",
    "Rows",
    "Summed",
    "Unknown",
    "is_reduced",
]

Sources = Sequence[Tensor]
"""One micro-batch's inputs, in the order the probe was given them."""


@dataclass(frozen=True)
class Count:
    """A count of one micro-batch (what a mean divides by).

    Attributes:
        of: the count of a micro-batch from its inputs (:data:`Sources`) and rows.
        what: a description for messages.
        any_rows: False when the count is known only for micro-batches of the watched one's
            shape (a size of something the model computes, not of its rows).
    """

    of: Callable[[Sources, int], float]
    what: str
    any_rows: bool = True

    def __call__(self, sources: Sources, rows: int) -> float:
        """The count of a micro-batch, computed on its inputs as they are, outside whatever
        mode the caller runs under (a shadow stage's meta values)."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return float(self.of(sources, rows))

    def times(self, factor: float) -> Count:
        of = self.of
        return Count(lambda s, r: factor * of(s, r), self.what, self.any_rows)

    def plus(self, other: Count) -> Count:
        a, b = self.of, other.of
        return Count(
            lambda s, r: a(s, r) + b(s, r),
            f"{self.what} + {other.what}",
            self.any_rows and other.any_rows,
        )


@dataclass(frozen=True)
class Const:
    """Does not depend on the batch; ``value`` when it is one number."""

    value: float | None = None


@dataclass(frozen=True)
class Rows:
    """Per-row values of the batch; ``replay`` recomputes them from the inputs (None when they
    depend on what the model computes)."""

    replay: _Replay | None = None


@dataclass(frozen=True)
class Summed:
    """A sum over the batch: micro-batch values add up. ``count`` gives its value for any
    micro-batch when it depends on the inputs alone (a count of real targets, a mask's sum, a
    size of the batch): then a mean may divide by it."""

    count: Count | None = None


@dataclass(frozen=True)
class Averaged:
    """A sum over the batch divided by ``count``."""

    count: Count


@dataclass(frozen=True)
class Unknown:
    """Reduced over the batch by ``op`` in ``where``, in a way that does not join."""

    op: str
    where: str
    why: str


Form = Const | Rows | Summed | Averaged | Unknown


def is_reduced(form: Form) -> bool:
    """Whether ``form`` is a value reduced over the batch (a loss, a statistic)."""
    return isinstance(form, (Summed, Averaged, Unknown))


# -- replaying the operations that made a value from the inputs -------------------------------
class _Replay:
    """``func`` applied to arguments whose input-made tensors are replayed first."""

    def __init__(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def __call__(self, sources: Sources, memo: dict[int, Any]) -> Any:
        if id(self) not in memo:
            args = _rebuild(self.args, sources, memo)
            kwargs = _rebuild(self.kwargs, sources, memo)
            with torch._C.DisableTorchFunction():
                memo[id(self)] = self.func(*args, **kwargs)
        return memo[id(self)]


class _Source(_Replay):
    """The call's ``index``-th batch tensor."""

    def __init__(self, index: int) -> None:
        super().__init__(operator.getitem, (), {})
        self.index = index

    def __call__(self, sources: Sources, memo: dict[int, Any]) -> Any:
        return sources[self.index]


@dataclass(frozen=True)
class _Ref:
    replay: _Replay


def _rebuild(value: Any, sources: Sources, memo: dict[int, Any]) -> Any:
    if isinstance(value, _Ref):
        return value.replay(sources, memo)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, sources, memo) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, sources, memo) for k, v in value.items()}
    return value


def _replayed(replay: _Replay, measure: Callable[[Any], Any], what: str) -> Count:
    """The count ``measure`` takes of a value recomputed from a micro-batch's inputs."""
    return Count(lambda sources, rows: float(measure(replay(sources, {}))), what)


# -- numbers the call reads off its tensors (sizes, .item()) ---------------------------------
class _Number:
    """A Python number read off a value of the batch, its :data:`Form` riding along through
    Python arithmetic (``B * T``)."""

    form: Form

    def _combine(self, other: Any, name: str, swapped: bool) -> Any:
        op, plain = _PY_OPS[name], _plain(self)
        value = op(other, plain) if swapped else op(plain, other)
        a, b = _form_of_number(self), _form_of_number(other)
        forms = [b, a] if swapped else [a, b]
        return _number(value, _arithmetic(name, forms, "Python arithmetic"))


def _plain(value: _Number) -> int | float:
    return int(value) if isinstance(value, int) else float(value)  # type: ignore[arg-type]


def _form_of_number(value: Any) -> Form:
    if isinstance(value, _Number):
        return value.form
    return Const(float(value)) if isinstance(value, (int, float)) else Const()


def _arith(name: str, swapped: bool = False) -> Callable[[Any, Any], Any]:
    def method(self: _Number, other: Any) -> Any:
        if not isinstance(other, (int, float)):
            return NotImplemented
        return self._combine(other, name, swapped)

    return method


_PY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "div": operator.truediv,
    "floordiv": operator.floordiv,
}


class _Int(_Number, int):
    __add__, __radd__ = _arith("add"), _arith("add", True)
    __sub__, __rsub__ = _arith("sub"), _arith("sub", True)
    __mul__, __rmul__ = _arith("mul"), _arith("mul", True)
    __truediv__, __rtruediv__ = _arith("div"), _arith("div", True)
    __floordiv__, __rfloordiv__ = _arith("floordiv"), _arith("floordiv", True)


class _Float(_Number, float):
    __add__, __radd__ = _arith("add"), _arith("add", True)
    __sub__, __rsub__ = _arith("sub"), _arith("sub", True)
    __mul__, __rmul__ = _arith("mul"), _arith("mul", True)
    __truediv__, __rtruediv__ = _arith("div"), _arith("div", True)


def _number(value: Any, form: Form) -> Any:
    if isinstance(form, Const) or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    made: _Int | _Float = _Int(value) if isinstance(value, int) else _Float(value)
    made.form = form
    return made


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
        sources: the call's tensors that hold the batch's rows (split into micro-batches).
        constants: tensors that do not depend on the batch (weights and buffers, arguments
            passed whole to every micro-batch).
        rows: the micro-batch's rows.
        names: module paths by ``id``, for messages.
        where: what the call is, for messages about operations outside any module.
        resolve: for a tensor the probe did not see made (a stage's leaf standing for another
            stage's value), the value it stands for.

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
    ) -> None:
        super().__init__()
        self.rows = rows
        self._forms: dict[int, tuple[Any, Form]] = {}
        self._constants = {id(t) for t in constants}
        self._names = names or {}
        self._default_where = where
        self._resolve = resolve
        self._modules = contextlib.ExitStack()
        for k, t in enumerate(sources):
            self._set(t, Rows(_Source(k)))

    def __enter__(self) -> Probe:
        self._modules.enter_context(_tracking_modules(self._names))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._modules.close()

    def form_of(self, value: Any) -> Form:
        """The form of a value the call made or was given."""
        if isinstance(value, _Number):
            return value.form
        if not isinstance(value, Tensor):
            return _form_of_number(value)
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
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return self._learn(func, args, kwargs, out)

    def _learn(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        name = _name(func)
        operands = [v for v in _operands(args, kwargs) if _is_operand(v)]
        if name not in _ADDITIVE | _SCALING:  # a size given as a shape, a split, a dim...
            operands = [v for v in operands if isinstance(v, Tensor)]
        forms = [self.form_of(v) for v in operands]
        if all(isinstance(f, Const) for f in forms):
            if isinstance(out, Tensor):
                self._set(out, _const(out))
            return out
        if name in _SIZES or func is _SHAPE:
            return self._size(name, operands[0], forms[0], out, args)
        if any(is_reduced(f) for f in forms):
            form = _arithmetic(name, forms, _where(self._default_where))
            self._set(out, form)
            return _number(out, form)
        if not isinstance(out, (Tensor, tuple, list)):
            return out  # a number read off per-row values
        reduced = self._reduction(func, name, args, kwargs, operands, forms, out)
        self._set(
            out, reduced if reduced is not None else Rows(self._replay(func, args, kwargs, forms))
        )
        return out

    def _replay(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        forms: list[Form],
    ) -> _Replay | None:
        """How to recompute an operation's result from the inputs, when every batch value it
        takes can be recomputed so."""
        if not all(isinstance(f, Const) or (isinstance(f, Rows) and f.replay) for f in forms):
            return None

        def template(value: Any) -> Any:
            if isinstance(value, Tensor):
                form = self.form_of(value)
                return _Ref(form.replay) if isinstance(form, Rows) and form.replay else value
            if isinstance(value, (list, tuple)):
                return type(value)(template(v) for v in value)
            return value

        if _name(func) in _MOVES:  # counts are taken where the inputs are (meta on a shadow)
            func = _cast_only
        return _Replay(func, template(args), {k: template(v) for k, v in kwargs.items()})

    # -- sizes --------------------------------------------------------------------------------
    def _size(self, name: str, tensor: Any, form: Form, out: Any, args: tuple[Any, ...]) -> Any:
        """A size read off a value of the batch: its first dimension counts the batch (when a
        multiple of the micro-batch's rows), the others are constants."""
        if not isinstance(tensor, Tensor) or not isinstance(form, Rows) or tensor.dim() == 0:
            return out
        if isinstance(out, torch.Size):
            return torch.Size([self._dim_size(tensor, form, d) for d in range(len(out))])
        if name == "numel":
            return _number(out, Summed(self._count(tensor, form, lambda t: t.numel(), "elements")))
        dim = args[1] if len(args) > 1 else 0
        if isinstance(out, int) and isinstance(dim, int):
            return self._dim_size(tensor, form, dim % tensor.dim())
        return out

    def _dim_size(self, tensor: Tensor, form: Form, d: int) -> Any:
        n = tensor.shape[d]
        if d != 0 or self.rows == 0 or n % self.rows:
            return n
        return _number(n, Summed(self._count(tensor, form, lambda t: t.shape[0], "rows")))

    def _count(
        self, tensor: Tensor, form: Form, measure: Callable[[Tensor], int], what: str
    ) -> Count:
        """``measure`` of a value of the batch, for any micro-batch: recomputed from the inputs,
        or scaled by rows when the value's first dimension is a multiple of them."""
        if isinstance(form, Rows) and form.replay is not None:
            return _replayed(form.replay, measure, f"the {what} of an input")
        value = float(measure(tensor))
        label = f"the {what} of a {tuple(tensor.shape)} value"
        if self.rows and tensor.shape[0] % self.rows == 0:
            per_row = value / self.rows
            return Count(lambda sources, rows: per_row * rows, label)
        return Count(lambda sources, rows: value, label, any_rows=False)

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
        """The form of ``out`` if the operation reduces a value of the batch to one number."""
        first = operands[0] if operands else None
        if not isinstance(out, Tensor) or out.dim() != 0 or not isinstance(first, Tensor):
            return None
        if first.dim() == 0:
            return None  # an element-wise operation on one value
        where = _where(self._default_where)
        replay = self._replay(func, args, kwargs, forms)
        if name in ("sum", "nansum", "count_nonzero"):
            return Summed(_replayed(replay, lambda t: t, "a sum of the inputs") if replay else None)
        if name in ("mean", "nanmean") and _all_dims(args, kwargs):
            return Averaged(self._count(first, forms[0], lambda t: t.numel(), "elements"))
        if _LOSSES.get(name) is func:
            return self._loss(func, args, kwargs, where)
        return Unknown(f"{name}()", where, "it reduces the batch to one value")

    def _loss(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], where: str
    ) -> Form:
        bound = _bind(func, args, kwargs)
        reduction = bound.get("reduction", "mean")
        name = func.__name__
        if reduction == "sum":
            return Summed()
        if name in ("cross_entropy", "nll_loss"):
            return self._class_loss(bound, name, where)
        if name == "kl_div" and reduction == "batchmean":
            return Averaged(self._count(bound["input"], Rows(), lambda t: t.shape[0], "rows"))
        if name == "ctc_loss":
            return Unknown(f"F.{name}()", where, "its mean divides each sequence by its length")
        elementwise = func(**{**_shapes_only(bound), "reduction": "none"})
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
        if isinstance(form, Rows) and form.replay is not None:
            replay = form.replay
            return Averaged(
                Count(
                    lambda sources, rows: float(_real_targets(replay(sources, {}), bound)),
                    f"the real targets of F.{name}()",
                )
            )
        return Unknown(
            f"F.{name}()",
            where,
            "its targets are computed by the model, so the count of real targets it divides by "
            "is not known before each micro-batch's forward",
        )


# -- arithmetic on values reduced over the batch -----------------------------------------------
def _arithmetic(name: str, forms: list[Form], where: str) -> Form:
    """The form of an operation on values at least one of which is reduced over the batch."""
    unknown = next((f for f in forms if isinstance(f, Unknown)), None)
    if unknown is not None:
        return unknown
    reduced = next(f for f in forms if is_reduced(f))
    if name in _LINEAR or name in _ITEMS:
        return reduced
    if any(isinstance(f, Rows) for f in forms):
        return Unknown(
            name, where, "it combines a value reduced over the batch with per-row values"
        )
    if len(forms) == 2 and name in _ADDITIVE:
        return _added(*(forms[::-1] if name == "rsub" else forms), name=name, where=where)
    if len(forms) == 2 and name in _SCALING:
        return _scaled(
            *(forms[::-1] if name in ("rdiv", "rmul") else forms), name=name, where=where
        )
    if name in ("sum", "mean") and len(forms) == 1:
        return reduced
    return Unknown(name, where, "it is not a sum or a mean of the batch")


def _added(a: Form, b: Form, *, name: str, where: str) -> Form:
    if isinstance(a, Const):
        a, b = b, a
    if isinstance(b, Const):
        if isinstance(a, Averaged):
            return a  # the shares add up to one: the constant is counted once
        return Unknown(name, where, "it adds a constant to a sum over the batch")
    if isinstance(a, Summed) and isinstance(b, Summed):
        both = a.count.plus(b.count) if a.count and b.count and name in ("add", "radd") else None
        return Summed(both)
    if isinstance(a, Averaged) and isinstance(b, Averaged) and a.count == b.count:
        return a
    return Unknown(name, where, "it adds values of the batch averaged over different counts")


def _scaled(a: Form, b: Form, *, name: str, where: str) -> Form:
    if name in ("mul", "rmul"):
        if isinstance(a, Const):
            a, b = b, a
        if not isinstance(b, Const):
            return Unknown("mul", where, "it multiplies two values of the batch")
        if isinstance(a, Summed) and a.count is not None and b.value is not None:
            return Summed(a.count.times(b.value))
        return Summed() if isinstance(a, Summed) else a
    if isinstance(b, Const):  # a / c, a // c
        if isinstance(a, Summed) and a.count is not None and b.value:
            return Summed(a.count.times(1.0 / b.value))
        return Summed() if isinstance(a, Summed) else a
    if isinstance(a, Summed) and isinstance(b, Summed) and b.count is not None:
        return Averaged(b.count)
    if isinstance(a, Const):
        return Unknown(name, where, "it divides by a value of the batch")
    return Unknown(name, where, "it divides by a value the model computes from the batch")


_MOVES = {"to", "cuda", "cpu"}


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
    real = target[target != bound.get("ignore_index", -100)]
    weight = bound.get("weight")
    return torch.tensor(real.numel()) if weight is None else weight.to(real.device)[real].sum()


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
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, torch.dtype):
        dim = None
    return dim is None or (isinstance(dim, (tuple, list)) and len(dim) == args[0].dim())


def _is_operand(value: Any) -> bool:
    return isinstance(value, (Tensor, int, float)) and not isinstance(value, bool)


def _operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _name(func: Callable[..., Any]) -> str:
    """A torch operation's name without its in-place, reflected or dunder spelling."""
    name: str = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and name[1:] in _ADDITIVE | _SCALING | {"truediv"}:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return _SPELLINGS.get(name, name)


_SPELLINGS = {
    "truediv": "div",
    "true_divide": "div",
    "divide": "div",
    "rtruediv": "rdiv",
    "subtract": "sub",
    "multiply": "mul",
    "floor_divide": "div",
    "floordiv": "div",
}
_SHAPE = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
_SIZES = {"size", "numel", "len"}
_ITEMS = {"item", "float", "int", "tolist"}  # a reduced value as a number, or cast
_LINEAR = {
    "clone",
    "detach",
    "to",
    "double",
    "half",
    "bfloat16",
    "type",
    "type_as",
    "contiguous",
    "reshape",
    "view",
    "view_as",
    "squeeze",
    "unsqueeze",
    "flatten",
    "neg",
    "getitem",
    "expand",
    "expand_as",
    "cpu",
    "cuda",
    "positive",
    "requires_grad",
}
_ADDITIVE = {"add", "sub", "radd", "rsub"}
_SCALING = {"mul", "rmul", "div", "rdiv"}
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
