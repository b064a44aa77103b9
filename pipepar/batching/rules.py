"""How a call is cut into micro-batches and its outputs joined back, argument by argument.

By default a tensor argument whose dimension 0 is the batch size is cut into row blocks and any
other argument goes whole to every micro-batch. Inputs that are not rows say otherwise, by the
name of the model's parameter (or its position):

* ``"rows"``: row blocks on dimension 0 (the default for a tensor with the batch's rows);
* ``"whole"``: the same value to every micro-batch (the default for anything else);
* :class:`Packed`: the items of every row one after another on a dimension, e.g. the patches of
  all images of a batch (``lengths`` gives each row's share of that dimension);
* :class:`Documents`: the argument delimits the documents packed in one row (restarting
  position ids, or ``cu_seqlens`` offsets) or is their longest length: the batch is cut at
  document boundaries (:mod:`pipepar.batching.documents`, which also recognises the layout);
* a function ``fn(value, pieces) -> [value of micro-batch 0, value of micro-batch 1, ...]``
  given the rows (or, cut by documents, the documents) of each micro-batch as ``range``\\ s.

Outputs are joined by the rule named for their key (``"image_hidden_states"``, or a key path
such as ``"[0]"``): ``"concat"`` (dimension 0, in micro-batch order), ``"sum"``, or a function
of the micro-batches' values. Without a rule, a tensor with the micro-batch's rows is
concatenated, one value reduced over the batch is joined by its shares, and a tensor packed like
a packed input (its dimension 0 in proportion to that input's) is concatenated in micro-batch
order.

Example:
    >>> import pipepar
    >>> grid = torch.tensor([[1, 2, 2], [1, 2, 4]])  # two images of 4 and 8 patches
    >>> rules = Rules.given(
    ...     {"pixel_values": Packed(lambda call: call["image_grid_thw"].prod(-1))}, None
    ... )
    >>> rules.input("pixel_values").name
    'packed'
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CHAIN_RULES",
    "Documents",
    "InputRule",
    "OutputRule",
    "Packed",
    "Rules",
    "argument_keys",
    "bind",
    "first_key",
    "packed_pieces",
    "row_lengths",
]


@dataclass(frozen=True)
class Packed:
    """An argument that holds the items of every row one after another on ``dim``: the
    patches of all images of a batch, the images of all rows, the tokens of all documents.

    Args:
        lengths: ``lengths(call) -> each row's length on dim`` (a tensor or sequence of
            ``batch size`` ints), where ``call`` maps the model's parameter names (and
            positions) to the whole batch's arguments.
        dim: the dimension the items are packed on.

    Example:
        >>> rule = Packed(lambda call: call["image_grid_thw"].prod(-1))
    """

    lengths: Callable[[Mapping[str | int, Any]], Tensor | Sequence[int]]
    dim: int = 0


@dataclass(frozen=True)
class Documents:
    """An argument about the documents packed one after another in a one-row batch: position
    ids restarting at 0 for each document (``(1, T)``), or offsets of their starts
    (``cu_seqlens``: ``[0, ..., T]``), or the longest document's length (an int). The batch is
    then cut at document boundaries into micro-batches of balanced tokens: every ``(1, T, ...)``
    tensor on dimension 1, offsets rebased, a longest length recomputed. The layout is
    recognised without it; declaring it makes that argument the one the documents are read
    from first (any other argument recognised as delimiting them must agree) and an int a
    longest length.

    Example:
        >>> rules = Rules.given({"position_ids": Documents()}, None)
        >>> rules.input("position_ids").name
        'documents'
    """


CustomSplit = Callable[[Any, Sequence[range]], Sequence[Any]]
CustomJoin = Callable[[Sequence[Any]], Any]
InputRule = str | Packed | Documents | CustomSplit
"""``"rows"``, ``"whole"``, a :class:`Packed`, :class:`Documents` or ``fn(value, pieces) ->
values``."""
OutputRule = str | CustomJoin
"""``"concat"``, ``"sum"`` or ``fn(values) -> joined``."""

CHAIN_RULES = (
    "split_inputs and join_outputs apply to a model called with its own arguments; an "
    "nn.Sequential's input is cut into row blocks and its output joined by rows: leave them "
    "out, or wrap a model whose forward takes the arguments by name"
)
INPUT_NAMES = ("rows", "whole")
OUTPUT_NAMES = ("concat", "sum")


@dataclass(frozen=True)
class Rule:
    """One argument's rule, checked: its ``name`` (``rows``, ``whole``, ``packed``,
    ``documents``, ``custom``) and what it needs."""

    name: str
    packed: Packed | None = None
    custom: CustomSplit | None = None


@dataclass(frozen=True)
class Rules:
    """A pipe's rules for cutting its calls and joining its outputs."""

    inputs: Mapping[str | int, Rule] = field(default_factory=dict)
    outputs: Mapping[str, OutputRule] = field(default_factory=dict)

    @staticmethod
    def given(
        split_inputs: Mapping[str | int, InputRule] | None,
        join_outputs: Mapping[str, OutputRule] | None,
    ) -> Rules:
        """The rules of ``wrap(split_inputs=..., join_outputs=...)``, checked.

        Raises:
            TypeError: a rule of a kind no argument can have, or keys of the wrong type.
        """
        inputs = {key: _input_rule(key, rule) for key, rule in _items(split_inputs, "split_inputs")}
        outputs = {
            key: _output_rule(key, rule) for key, rule in _items(join_outputs, "join_outputs")
        }
        return Rules(inputs, outputs)

    def input(self, key: str | int) -> Rule | None:
        return self.inputs.get(key)

    def output(self, path: str) -> OutputRule | None:
        """The rule of an output leaf at key path ``path`` (``"['logits']"``, ``"[0]"``,
        ``".loss"``): by its full path, or the name of its first key."""
        if path in self.outputs:
            return self.outputs[path]
        return self.outputs.get(first_key(path))

    def with_defaults(self, defaults: Mapping[str | int, Rule]) -> Rules:
        """These rules over ``defaults`` (recognised layouts): what the caller says wins."""
        return Rules({**defaults, **self.inputs}, self.outputs)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)


def _items(rules: Mapping[Any, Any] | None, argument: str) -> list[tuple[Any, Any]]:
    if rules is None:
        return []
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"{argument} must be a dict from argument name to rule, but got "
            f"{type(rules).__name__}; e.g. {argument}={_example(argument)}"
        )
    for key in rules:
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(
                f"{argument} keys are names (or positions) but got {key!r}; e.g. "
                f"{argument}={_example(argument)}"
            )
    return list(rules.items())


def _example(argument: str) -> str:
    if argument == "split_inputs":
        return '{"pixel_values": pipepar.Packed(lambda call: call["image_grid_thw"].prod(-1))}'
    return '{"image_hidden_states": "concat"}'


def _input_rule(key: str | int, rule: Any) -> Rule:
    if isinstance(rule, Packed):
        if not callable(rule.lengths):
            raise TypeError(
                f"split_inputs[{key!r}] is Packed({rule.lengths!r}): lengths must be a function "
                "of the call giving each row's length, e.g. Packed(lambda call: "
                'call["image_grid_thw"].prod(-1))'
            )
        return Rule("packed", packed=rule)
    if isinstance(rule, Documents):
        return Rule("documents")
    if isinstance(rule, str):
        if rule not in INPUT_NAMES:
            raise ValueError(
                f"split_inputs[{key!r}] is {rule!r}, not one of {list(INPUT_NAMES)}; pass "
                "'rows', 'whole', pipepar.Packed(lengths), pipepar.Documents() or "
                "fn(value, pieces)"
            )
        return Rule(rule)
    if callable(rule):
        return Rule("custom", custom=rule)
    raise TypeError(
        f"split_inputs[{key!r}] is a {type(rule).__name__}; pass 'rows', 'whole', "
        "pipepar.Packed(lengths) or fn(value, pieces) -> one value per micro-batch"
    )


def _output_rule(key: str, rule: Any) -> OutputRule:
    if not isinstance(key, str):
        raise TypeError(
            f"join_outputs keys are output names or key paths, but got {key!r}; e.g. "
            'join_outputs={"image_hidden_states": "concat"}'
        )
    if isinstance(rule, str) and rule in OUTPUT_NAMES:
        return rule
    if callable(rule) and not isinstance(rule, str):
        return rule
    raise ValueError(
        f"join_outputs[{key!r}] is {rule!r}; pass 'concat', 'sum' or fn(values) -> joined"
    )


def first_key(path: str) -> str:
    """``"['a']['b']"`` -> ``"a"``, ``".loss"`` -> ``"loss"``, ``"[0]"`` -> ``"0"``."""
    head = path.split("]")[0].split(".")
    text = head[1] if path.startswith(".") and len(head) > 1 else head[0]
    return text.strip("[]'\"")


# -- binding a call's arguments to names ---------------------------------------------------------
def bind(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str | int, Any]:
    """The call's arguments by the model's parameter names; positions the signature does not
    name (``*args``) by their index.

    Example:
        >>> bind(nn.Linear(2, 2), (torch.zeros(1, 2),), {})
        {'input': tensor([[0., 0.]])}
    """
    names = _positional_names(model)
    named: dict[str | int, Any] = {}
    for k, value in enumerate(args):
        named[names[k] if k < len(names) else k] = value
    named.update(kwargs)
    return named


def _positional_names(model: nn.Module) -> list[str]:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def argument_keys(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str | int]:
    """Each argument's key in :func:`bind`, in the order of ``(args, kwargs)``."""
    return list(bind(model, args, {k: None for k in kwargs}))[: len(args)] + list(kwargs)


# -- cutting by a packed rule -------------------------------------------------------------------
def packed_pieces(
    value: Tensor, rule: Packed, lengths: Tensor, pieces: Sequence[range], key: str | int
) -> list[Tensor]:
    """The micro-batches' parts of a packed tensor: rows ``pieces[i]`` take the items of those
    rows, by ``lengths`` (each row's length on the rule's dim).

    Raises:
        ValueError: the lengths do not add up to the tensor's size on the dim.
    """
    dim = rule.dim if rule.dim >= 0 else value.dim() + rule.dim
    if dim >= value.dim():
        raise ValueError(
            f"split_inputs[{key!r}] packs on dim {rule.dim}, but the argument has shape "
            f"{tuple(value.shape)}; pass Packed(lengths, dim=...) with one of its dimensions"
        )
    total = int(lengths.sum())
    if total != value.shape[dim]:
        raise ValueError(
            f"argument {key!r} has {value.shape[dim]} items on dim {dim}, but its packed rule "
            f"gives the rows lengths {lengths.tolist()} adding up to {total}; give lengths that "
            "sum to the packed dimension (each row's items, in row order)"
        )
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    return [value.narrow(dim, offsets[p.start], offsets[p.stop] - offsets[p.start]) for p in pieces]


def row_lengths(rule: Packed, call: Mapping[str | int, Any], rows: int, key: str | int) -> Tensor:
    """Each row's length on a packed argument's dim, as the rule computes it; checked."""
    lengths = rule.lengths(call)
    found = torch.as_tensor(lengths).reshape(-1).to("cpu", torch.long)
    if found.numel() != rows or bool((found < 0).any()):
        raise ValueError(
            f"the packed rule of argument {key!r} gave lengths {found.tolist()} for a batch of "
            f"{rows} rows; it must give one length >= 0 per row"
        )
    return found
