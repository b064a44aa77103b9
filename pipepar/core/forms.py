"""What a value computed from a batch is, as far as joining micro-batches goes: its *form*.

A pipe runs a call once per micro-batch and must join what the micro-batches return into what
the plain model returns on the whole batch. For per-row values that is a concatenation; for a
value *reduced over the batch* (a loss) it depends on what the code divides by. The forms:

* :class:`Const`: does not depend on the batch (weights, numbers, a count the caller passes);
* :class:`Rows`: per-row values of the batch (inputs, activations, targets, masks);
* :class:`Summed`: a sum over the batch: the micro-batches' values add up;
* :class:`Averaged`: a sum over the batch divided by a :class:`Count` of it: the micro-batches'
  values join weighted by their counts;
* :class:`Unknown`: reduced over the batch in a way no weighting of the micro-batch values can
  join (a product of two sums, a ``log`` of a mean, a max...).

:func:`arithmetic` gives the form of an operation on reduced values; a :class:`Count` that
depends only on the inputs is recomputed for any micro-batch by a :class:`Replay` of the
operations that made it. :mod:`pipepar.core.reductions` learns the forms of a call's values.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "ADDITIVE",
    "ITEMS",
    "LINEAR",
    "SCALING",
    "Averaged",
    "Const",
    "Count",
    "Form",
    "Number",
    "Ref",
    "Replay",
    "Rows",
    "Source",
    "Sources",
    "Summed",
    "Unknown",
    "arithmetic",
    "form_of_number",
    "is_reduced",
    "number",
    "op_name",
    "replayed",
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
    per_row: bool = False
    """The count is a fixed number per row: two such counts give every micro-batch the same
    share (its rows over the batch's)."""
    fixed: float | None = None
    """The count, when it is one number for micro-batches of the watched one's shape."""
    measured: bool = False
    """The count was measured on the watched micro-batch (and scaled by rows), not recomputed
    from each one's inputs: right only for micro-batches of the watched one's shape beyond
    their rows (not for micro-batches of other sequence lengths)."""

    def same_shares(self, other: Count) -> bool:
        """Whether the two counts give every micro-batch the same share."""
        if self == other or (self.per_row and other.per_row):
            return True
        return self.fixed is not None and self.fixed == other.fixed

    def __call__(self, sources: Sources, rows: int) -> float:
        """The count of a micro-batch, computed on its inputs as they are, outside whatever
        mode the caller runs under (a shadow stage's meta values)."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return float(self.of(sources, rows))

    def times(self, factor: float) -> Count:
        of = self.of
        return dataclasses.replace(self, of=lambda s, r: factor * of(s, r), fixed=None)

    def plus(self, other: Count) -> Count:
        a, b = self.of, other.of
        return Count(
            lambda s, r: a(s, r) + b(s, r),
            f"{self.what} + {other.what}",
            self.any_rows and other.any_rows,
            self.per_row and other.per_row,
            measured=self.measured or other.measured,
        )


@dataclass(frozen=True)
class Const:
    """Does not depend on the batch; ``value`` when it is one number."""

    value: float | None = None


@dataclass(frozen=True)
class Rows:
    """Per-row values of the batch; ``replay`` recomputes them from the inputs (None when they
    depend on what the model computes); ``dim`` holds the rows (None: not known)."""

    replay: Replay | None = None
    dim: int | None = None
    mixed: Any = None
    """The reduction over the rows that made these integer values (a count of the batch), a
    ``Coupling``: refused where they reach floating-point values."""


@dataclass(frozen=True)
class Summed:
    """A sum over the batch: micro-batch values add up. ``count`` gives its value for any
    micro-batch when it depends on the inputs alone (a count of real targets, a mask's sum, a
    size of the batch): then a mean may divide by it."""

    count: Count | None = None
    items: Count | None = None
    """What the sum adds one term for, when the inputs alone tell (the real targets of a
    summed cross-entropy): a cut that could split those terms is checked by it."""


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
class Replay:
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


class Source(Replay):
    """The call's ``index``-th batch tensor."""

    def __init__(self, index: int) -> None:
        super().__init__(operator.getitem, (), {})
        self.index = index

    def __call__(self, sources: Sources, memo: dict[int, Any]) -> Any:
        return sources[self.index]


@dataclass(frozen=True)
class Ref:
    replay: Replay


def _rebuild(value: Any, sources: Sources, memo: dict[int, Any]) -> Any:
    if isinstance(value, Ref):
        return value.replay(sources, memo)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, sources, memo) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, sources, memo) for k, v in value.items()}
    return value


def replayed(replay: Replay, measure: Callable[[Any], Any], what: str) -> Count:
    """The count ``measure`` takes of a value recomputed from a micro-batch's inputs."""
    return Count(lambda sources, rows: float(measure(replay(sources, {}))), what)


# -- numbers the call reads off its tensors (sizes, .item()) ---------------------------------
class Number:
    """A Python number read off a value of the batch, its :data:`Form` riding along through
    Python arithmetic (``B * T``)."""

    form: Form

    def _combine(self, other: Any, name: str, swapped: bool) -> Any:
        op, plain = _PY_OPS[name], _plain(self)
        value = op(other, plain) if swapped else op(plain, other)
        a, b = form_of_number(self), form_of_number(other)
        forms = [b, a] if swapped else [a, b]
        return number(value, arithmetic(name, forms, "Python arithmetic"))


def _plain(value: Number) -> int | float:
    return int(value) if isinstance(value, int) else float(value)  # type: ignore[arg-type]


def form_of_number(value: Any) -> Form:
    if isinstance(value, Number):
        return value.form
    return Const(float(value)) if isinstance(value, (int, float)) else Const()


def _arith(name: str, swapped: bool = False) -> Callable[[Any, Any], Any]:
    def method(self: Number, other: Any) -> Any:
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


class _Int(Number, int):
    __add__, __radd__ = _arith("add"), _arith("add", True)
    __sub__, __rsub__ = _arith("sub"), _arith("sub", True)
    __mul__, __rmul__ = _arith("mul"), _arith("mul", True)
    __truediv__, __rtruediv__ = _arith("div"), _arith("div", True)
    __floordiv__, __rfloordiv__ = _arith("floordiv"), _arith("floordiv", True)


class _Float(Number, float):
    __add__, __radd__ = _arith("add"), _arith("add", True)
    __sub__, __rsub__ = _arith("sub"), _arith("sub", True)
    __mul__, __rmul__ = _arith("mul"), _arith("mul", True)
    __truediv__, __rtruediv__ = _arith("div"), _arith("div", True)


def number(value: Any, form: Form) -> Any:
    if isinstance(form, Const) or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    made: _Int | _Float = _Int(value) if isinstance(value, int) else _Float(value)
    made.form = form
    return made


# -- arithmetic on values reduced over the batch -----------------------------------------------
def arithmetic(name: str, forms: list[Form], where: str) -> Form:
    """The form of an operation on values at least one of which is reduced over the batch."""
    unknown = next((f for f in forms if isinstance(f, Unknown)), None)
    if unknown is not None:
        return unknown
    reduced = next(f for f in forms if is_reduced(f))
    if name in LINEAR or name in ITEMS:
        return reduced
    if any(isinstance(f, Rows) for f in forms):
        return Unknown(
            name, where, "it combines a value reduced over the batch with per-row values"
        )
    if len(forms) == 2 and name in ADDITIVE:
        return _added(*(forms[::-1] if name == "rsub" else forms), name=name, where=where)
    if len(forms) == 2 and name in SCALING:
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
        adds = name in ("add", "radd")
        both = a.count.plus(b.count) if a.count and b.count and adds else None
        items = a.items.plus(b.items) if a.items and b.items and adds else None
        return Summed(both, items)
    if isinstance(a, Averaged) and isinstance(b, Averaged) and a.count.same_shares(b.count):
        if a.count == b.count:
            return a
        # Two counts in proportion for micro-batches of one shape, not of other lengths.
        return Averaged(dataclasses.replace(a.count, measured=True))
    return Unknown(name, where, "it adds values of the batch averaged over different counts")


def _scaled(a: Form, b: Form, *, name: str, where: str) -> Form:
    if name in ("mul", "rmul"):
        if isinstance(a, Const):
            a, b = b, a
        if not isinstance(b, Const):
            return Unknown("mul", where, "it multiplies two values of the batch")
        if isinstance(a, Summed) and a.count is not None and b.value is not None:
            return Summed(a.count.times(b.value), a.items)
        return Summed(None, a.items) if isinstance(a, Summed) else a
    if isinstance(b, Const):  # a / c, a // c
        if isinstance(a, Summed) and a.count is not None and b.value:
            return Summed(a.count.times(1.0 / b.value), a.items)
        return Summed(None, a.items) if isinstance(a, Summed) else a
    if isinstance(a, Summed) and isinstance(b, Summed) and b.count is not None:
        return Averaged(b.count)
    if isinstance(a, Const):
        return Unknown(name, where, "it divides by a value of the batch")
    return Unknown(name, where, "it divides by a value the model computes from the batch")


def op_name(func: Callable[..., Any]) -> str:
    """A torch operation's name without its in-place, reflected or dunder spelling."""
    name: str = getattr(func, "__name__", "")
    if name == "__get__":  # a property read (``x.T``, ``x.mT``): the property's name
        return str(getattr(getattr(func, "__self__", None), "__name__", "get"))
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and name[1:] in ADDITIVE | SCALING | {"truediv"}:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return _SPELLINGS.get(name, name)


def writes_in_place(func: Callable[..., Any]) -> bool:
    """Whether a torch operation writes into its first argument: an in-place method
    (``add_``, ``torch._foreach_add_``) or an in-place operator (``+=`` is ``__iadd__``,
    ``t[i] = v`` is ``__setitem__``).

    Example:
        >>> writes_in_place(torch.Tensor.add_), writes_in_place(torch.Tensor.__iadd__)
        (True, True)
        >>> writes_in_place(torch.Tensor.add), writes_in_place(torch.Tensor._values)
        (False, False)
    """
    name: str = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS


_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
     "__setitem__"}
)  # fmt: skip

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
ITEMS = {"item", "float", "int", "tolist"}  # a reduced value as a number, or cast
LINEAR = {
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
ADDITIVE = {"add", "sub", "radd", "rsub"}
SCALING = {"mul", "rmul", "div", "rdiv"}
