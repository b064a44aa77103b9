"""Arguments passed whole to every micro-batch, followed through a call so that one consumed
as if it were the micro-batch's own is refused: :class:`WholeInputs`.

An argument pipepar cannot cut (no rows on dimension 0, no rule, not recognised as packed)
goes whole to every micro-batch. That is right for a flag, a scale or a table the model looks
up, and silently wrong for items of the rows packed one after another: a model that scatters
the features of all images of the batch into the image tokens of its rows
(``embeds.masked_scatter(image_tokens, features)``) takes them in order, so every micro-batch
would take the first images of the batch, not its own, and compute other numbers than the
plain model. The probe (:class:`pipepar.core.reductions.Probe`) follows what is computed from
such arguments alone and refuses, at the first call, an operation that fills per-row positions
from it item after item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from pipepar.core.forms import Const, Form

__all__ = ["SCATTERS", "WholeInputs"]

SCATTERS = frozenset({"masked_scatter", "index_put", "setitem"})
"""Operations that fill selected positions with a source's items in order."""


class WholeInputs:
    """The values a call computes from its arguments passed whole alone, by argument name.

    Args:
        named: each argument passed whole to every one of several micro-batches (its name and
            its tensors).

    Example:
        >>> image = torch.randn(3, 4)
        >>> whole = WholeInputs([("pixel_values", image)])
        >>> features = image * 2
        >>> whole.follow([image], [Rows()], features)
        >>> sorted(whole.names(features))
        ['pixel_values']
    """

    def __init__(self, named: Sequence[tuple[str, Tensor]] = ()) -> None:
        self._of: dict[int, tuple[Tensor, frozenset[str]]] = {}
        for name, t in named:
            self._mark(t, frozenset({name}))

    def __bool__(self) -> bool:
        return bool(self._of)

    def names(self, value: Any) -> frozenset[str]:
        """The arguments passed whole ``value`` is computed from alone (none: other values)."""
        found = self._of.get(id(value)) if isinstance(value, Tensor) else None
        return found[1] if found is not None and found[0] is value else frozenset()

    def follow(self, operands: Sequence[Any], forms: Sequence[Form], out: Any) -> None:
        """``out`` is computed from ``operands`` (of ``forms``): from arguments passed whole
        when some are and the others are constants."""
        names = [self.names(v) for v in operands]
        if any(names) and all(n or isinstance(f, Const) for n, f in zip(names, forms)):
            joined = frozenset().union(*names)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                self._mark(t, joined)

    def release(self) -> None:
        self._of.clear()

    def _mark(self, t: Any, names: frozenset[str]) -> None:
        if isinstance(t, Tensor):
            self._of[id(t)] = (t, names)

    def refusal(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        of_rows: Callable[[Any], bool],
        where: str,
    ) -> str | None:
        """Why operation ``name`` is refused, when it fills positions chosen per row
        (``of_rows``) with the items of a value computed from arguments passed whole, in
        order: the operation, the module, the arguments and the fix; None when it is not."""
        names = self.names(_positional_source(name, args, kwargs, of_rows))
        return _message(name, where, sorted(names)) if names else None


def _positional_source(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], of_rows: Callable[[Any], bool]
) -> Any:
    """The value whose items ``name`` takes one after another into per-row positions."""
    target = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if name == "masked_scatter":
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        source = args[2] if len(args) > 2 else kwargs.get("source")
        return source if of_rows(mask) or of_rows(target) else None
    index = args[1] if len(args) > 1 else kwargs.get("indices", kwargs.get("key"))
    source = args[2] if len(args) > 2 else kwargs.get("values", kwargs.get("value"))
    indices = index if isinstance(index, (tuple, list)) else (index,)
    masks = [i for i in indices if isinstance(i, Tensor) and not i.is_floating_point()]
    if not any(of_rows(i) for i in masks) or not isinstance(source, Tensor):
        return None
    return source if source.dim() > 0 and source.shape[0] > 1 else None  # not one broadcast


def _message(name: str, where: str, names: list[str]) -> str:
    first = names[0]
    return (
        f"{name}() in {where} fills positions of the rows with the items of "
        f"{', '.join(repr(n) for n in names)}, one after another, but that argument goes whole "
        "to every micro-batch (its dimension 0 is not the batch's rows and pipepar could not "
        "tell which of its items belong to which row): every micro-batch would take the first "
        "items of the whole batch, not its own, and compute other numbers than the plain "
        "model. Say how its items belong to the rows: wrap(..., split_inputs="
        f"{{{first!r}: pipepar.Packed(lambda call: <each row's count of items>)}}), or pass "
        "chunks=1"
    )
