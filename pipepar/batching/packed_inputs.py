"""The packed inputs of multimodal models, recognised from the call itself so that they need no
``split_inputs``.

transformers' vision-language models take the images of a batch packed one after another, not
as rows: Llava's ``pixel_values`` holds every image of the batch (a row may have none or
several), Qwen2-VL's holds the patches of every image and ``image_grid_thw`` one line per image.
Each image stands in ``input_ids`` as placeholder tokens (the config's ``image_token_id`` or
``image_token_index``, ``video_token_id``, ``audio_token_id``, in sub-configs too), and a row's
share of a packed argument is known from its placeholders:

* by an integer grid's per-item product: ``image_grid_thw``'s ``t * h * w`` is proportional to
  the image's tokens, so a row takes the grid lines whose tokens add up to its count;
* else one item per run of placeholders (text parts the images of a row), when the runs of
  all rows add up to the tensor's items (Llava's images, LlavaNext's of any size);
* else in proportion to them: a tensor of ``D`` items whose rows take ``count * D / total``
  items each (Qwen2-VL's patches, four per token).

A tensor of two dimensions or more that is no value per token (its shape does not hold the
token ids' rows and positions) is recognised when one placeholder places its items and no
other places them differently; where two do, the one named in the argument's name wins
(``pixel_values_videos``: ``video``), and an argument named after none takes none that another
argument of its kind (floating or integer, its dimensions) is named after (``pixel_values`` is
left the images). Its dimension 0 may be the batch's rows by chance (four images for four
rows); a tensor of each row's items padded to the most a row holds (Idefics3's rows x images x
pixels) stays rows. An argument recognised nowhere stays whole (the probe refuses a whole
argument scattered into the rows: :mod:`pipepar.core.whole_inputs`).

A micro-batch whose rows hold no item of a recognised floating-point argument (pixels) gets
``None`` for it, as the plain model does for a batch without images (a vision tower cannot run
on no image); integer ones (grids) stay, empty. What it returns without them is joined by
:func:`aligned`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching.rules import Packed, Rule

__all__ = ["Recognised", "aligned", "placeholders", "recognised"]

_PLACEHOLDER = re.compile(r"^(image|video|audio)_token_(id|index)$")


def placeholders(model: nn.Module) -> dict[str, int]:
    """The placeholder token ids of the model's config (and its sub-configs), by modality.

    Example:
        >>> from transformers import LlavaConfig, LlavaForConditionalGeneration
        >>> placeholders(LlavaForConditionalGeneration(LlavaConfig(...)))  # doctest: +SKIP
        {'image': 32000}
    """
    found: dict[str, int] = {}
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return found
    stack: list[Any] = [to_dict()]
    while stack:
        entries = stack.pop()
        for name, value in entries.items():
            if isinstance(value, dict):
                stack.append(value)
                continue
            match = _PLACEHOLDER.match(str(name))
            if match and isinstance(value, int) and not isinstance(value, bool):
                found.setdefault(match.group(1), value)
    return found


@dataclass(frozen=True)
class Recognised:
    """What a call's placeholders tell: the packed rules of its arguments, each recognised
    argument's items per row (packed, or padded per row) and each modality's placeholders
    per row."""

    rules: dict[str | int, Rule]
    items: dict[str | int, tuple[int, ...]]
    placeholders: tuple[Tensor, ...]

    def __bool__(self) -> bool:
        return bool(self.items)

    def placeholders_of(self, pieces: Sequence[range]) -> list[tuple[int, ...]]:
        """Each modality's placeholders in each micro-batch of rows ``pieces``."""
        return [tuple(int(c[p.start : p.stop].sum()) for p in pieces) for c in self.placeholders]

    def absent_when_empty(self, calls: list[Any], pieces: Sequence[range]) -> list[Any]:
        """``calls`` (of rows ``pieces``) with ``None`` for each recognised floating-point
        argument passed by keyword whose items a micro-batch holds none of (a vision tower
        runs on no image of a text-only batch); its part kept as :attr:`Call.absent`."""
        return [
            _without(call, [k for k, n in self.items.items() if sum(n[p.start : p.stop]) == 0])
            for call, p in zip(calls, pieces)
        ]


def recognised(
    model: nn.Module,
    keys: Sequence[str | int],
    values: Sequence[Any],
    given: Sequence[Rule | None],
    n: int,
) -> Recognised | None:
    """The packed rules of the call's arguments that hold items of the rows' placeholders
    (None when there are none).

    Args:
        model: the model (its config names the placeholder tokens).
        keys, values: the call's arguments, by the model's parameter names.
        given: the caller's rule for each argument (those with one are left to it).
        n: the batch's rows.
    """
    if not _some_other_shape(values):
        return None  # every tensor of two dimensions is (rows, tokens): a text model's call
    ids = placeholders(model)
    rows = [v for v, r in zip(values, given) if ids and _token_rows(v, r, n)]
    tokens = [t for t in rows if _holds_any(t, ids.values())]
    free = [
        (key, value)
        for key, value, rule in zip(keys, values, given)
        if rule is None and _items_of(value, tokens)
    ]
    counts = _counts(ids, tokens, n) if free else {}
    if not counts:
        return None
    fits = {key: _fits(value, counts) for key, value in free}
    kinds = {key: _kind(value) for key, value in free}
    named = {(kinds[key], m) for key, found in fits.items() for m in found if m in str(key)}
    rules: dict[str | int, Rule] = {}
    items: dict[str | int, tuple[int, ...]] = {}
    for key, value in free:
        found = fits[key]
        if len(set(found.values())) > 1:  # placeholders that disagree: by name, else not taken
            found = {m: f for m, f in found.items() if m in str(key)} or {
                m: f for m, f in found.items() if (kinds[key], m) not in named
            }
        if len(set(found.values())) == 1:
            items[key] = next(iter(found.values()))
            if not _padded_rows(value, items[key], n):  # else its rows are cut as rows
                rules[key] = Rule("packed", packed=Packed(_fixed(items[key])))
    return Recognised(rules, items, tuple(c for c, _ in counts.values()))


def _some_other_shape(values: Sequence[Any]) -> bool:
    shapes = {tuple(v.shape[:2]) for v in values if isinstance(v, Tensor) and v.dim() > 1}
    return len(shapes) > 1


def _fixed(lengths: tuple[int, ...]) -> Callable[[Mapping[str | int, Any]], Tensor]:
    found = torch.tensor(lengths, dtype=torch.long)
    return lambda call: found


def _holds_any(tokens: Tensor, ids: Iterable[int]) -> bool:
    return bool(torch.isin(tokens, torch.tensor(list(ids), device=tokens.device)).any())


def _kind(value: Tensor) -> tuple[bool, int]:
    return value.is_floating_point(), value.dim()


def _token_rows(value: Any, rule: Rule | None, n: int) -> bool:
    """Whether ``value`` is an integer tensor of the batch's rows (token ids, labels)."""
    return (
        (rule is None or rule.name == "rows")
        and isinstance(value, Tensor)
        and value.dim() > 1
        and value.shape[0] == n
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _counts(
    ids: Mapping[str, int], tokens: Sequence[Tensor], n: int
) -> dict[str, tuple[Tensor, Tensor]]:
    """Each modality's placeholders per row and their runs (the items they stand for, when
    text parts them) per row, in the tensor that holds most of them (the token ids, not
    labels that hide some)."""
    counts: dict[str, tuple[Tensor, Tensor]] = {}
    for modality, token in ids.items():
        masks = [(t == token).reshape(n, -1).to("cpu") for t in tokens]
        best = max(masks, key=lambda mask: int(mask.sum()), default=None)
        if best is not None and int(best.sum()) > 0:
            starts = best & ~torch.nn.functional.pad(best[:, :-1], (1, 0), value=False)
            counts[modality] = (best.sum(1), starts.sum(1))
    return counts


def _items_of(value: Any, tokens: Sequence[Tensor]) -> bool:
    """Whether ``value`` may hold items of the rows: a tensor of two dimensions or more that
    is no value per token (its shape holds no token tensor's rows and positions)."""
    if not isinstance(value, Tensor) or value.dim() < 2 or not tokens:
        return False
    return not any(_holds(tuple(value.shape), tuple(t.shape[:2])) for t in tokens)


def _holds(shape: tuple[int, ...], part: tuple[int, ...]) -> bool:
    """Whether ``part`` (rows, tokens) lies in ``shape``: a value per token, not items."""
    return any(shape[k : k + len(part)] == part for k in range(len(shape) - len(part) + 1))


def _fits(value: Tensor, counts: Mapping[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[int, ...]]:
    """Each row's items of ``value``, by each modality whose placeholders place them: by the
    walk over a grid, else one item per run of placeholders when there are as many, else in
    proportion to them."""
    found: dict[str, tuple[int, ...]] = {}
    for modality, (count, runs) in counts.items():
        lengths = _by_grid(value, count) if _is_grid(value) else None
        if lengths is None and int(runs.sum()) == value.shape[0]:
            lengths = tuple(runs.tolist())
        lengths = lengths if lengths is not None else _in_proportion(value.shape[0], count)
        if lengths is not None:
            found[modality] = lengths
    return found


def _padded_rows(value: Tensor, lengths: tuple[int, ...], n: int) -> bool:
    """Whether ``value`` holds each row's items on dimension 1, padded to the most a row
    holds (Idefics3's ``pixel_values``: rows x images x pixels), not items packed."""
    return value.shape[0] == n and value.dim() > 2 and value.shape[1] == max(lengths)


def _is_grid(value: Tensor) -> bool:
    return value.dim() == 2 and not value.is_floating_point() and bool((value > 0).all())


def _in_proportion(items: int, count: Tensor) -> tuple[int, ...] | None:
    """Each row's items when they are in proportion to its placeholders."""
    total = int(count.sum())
    scaled = count * items
    if bool((scaled % total != 0).any()):
        return None
    return tuple((scaled // total).tolist())


def _by_grid(grid: Tensor, count: Tensor) -> tuple[int, ...] | None:
    """Each row's grid lines, when the lines' products (proportional to their tokens) add up
    to every row's placeholders in order."""
    weight = grid.to("cpu", torch.long).prod(-1)
    total_w, total_c = int(weight.sum()), int(count.sum())
    ends = torch.cat([weight.new_zeros(1), torch.cumsum(weight, 0) * total_c])  # items' ends
    targets = torch.cumsum(count.to(torch.long), 0) * total_w  # rows' ends, in one unit
    at = torch.searchsorted(ends, targets)
    if bool((at >= len(ends)).any()) or bool((ends[at] != targets).any()):
        return None
    return tuple(torch.diff(at, prepend=at.new_zeros(1)).tolist())


# -- micro-batches without items -----------------------------------------------------------------
def _without(call: Any, keys: Sequence[str | int]) -> Any:
    names = {k for k in keys if isinstance(k, str) and _floating(call.kwargs.get(k))}
    if not names:
        return call
    leaves = pytree.tree_leaves((call.args, call.kwargs))
    parts = {id(call.kwargs[name]) for name in names}
    absent = tuple((k, t) for k, t in enumerate(leaves) if id(t) in parts)
    kwargs = {k: (None if k in names else v) for k, v in call.kwargs.items()}
    return dataclasses.replace(call, kwargs=kwargs, absent=absent)


def _floating(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


# -- outputs of micro-batches without items -------------------------------------------------------
def aligned(outputs: Sequence[Any]) -> list[Any]:
    """The micro-batches' outputs with the same keys: an output a micro-batch without items
    leaves out (Llava's ``image_hidden_states``) is, in it, empty tensors shaped like the
    others' (joined in micro-batch order, they add nothing)."""
    outputs = list(outputs)
    mappings = [o for o in outputs if isinstance(o, Mapping)]
    if len(mappings) != len(outputs) or len({tuple(o.keys()) for o in mappings}) < 2:
        return outputs
    order = _key_order(mappings)
    return [_filled(o, order, mappings) for o in mappings]


def _key_order(outputs: Sequence[Mapping[Any, Any]]) -> list[Any]:
    fields: tuple[dataclasses.Field[Any], ...] = ()
    if dataclasses.is_dataclass(outputs[0]):
        fields = dataclasses.fields(outputs[0])
    seen = {k for o in outputs for k in o}
    order = [f.name for f in fields if f.name in seen]
    for o in outputs:
        order += [k for k in o if k not in order]
    return order


def _filled(
    output: Mapping[Any, Any], order: list[Any], others: Sequence[Mapping[Any, Any]]
) -> Any:
    if all(k in output for k in order):
        return output
    values = {}
    for key in order:
        if key in output:
            values[key] = output[key]
            continue
        like = next((o[key] for o in others if o.get(key) is not None), None)
        leaves = pytree.tree_leaves(like)
        if not leaves or not all(isinstance(t, Tensor) and t.dim() > 0 for t in leaves):
            return output  # not an output of items: the join says what differs
        values[key] = pytree.tree_map(lambda t: t.new_empty((0, *t.shape[1:])), like)
    if dataclasses.is_dataclass(output):
        return type(output)(**values)  # a ModelOutput, its fields in their order
    return values
