"""Weights that one stage holds and a later stage's units use too (a language model's token
embedding and its tied head): one alias per weight and using stage for a whole mini-batch.

The using stage computes with the alias, a leaf standing for the weight on its device (the
weight itself, detached, on the holder's device; a copy on another). It is made once per
mini-batch, not per micro-batch, so the using stage treats it as one of its own weights: its
gradient is summed over the micro-batches in one buffer (in place, by the weight products of
:mod:`pipepar.core.split_backward`), and a zero-bubble schedule computes it in W, not in the B
the previous stage waits for. The runtime adds the sum to the holder's gradient after the step.

    >>> import torch
    >>> from torch import nn
    >>> weight = nn.Parameter(torch.ones(2, 2))
    >>> uses = {1: [weight]}
    >>> leaves = alias_leaves(uses, [torch.device("cpu")] * 2)
    >>> leaf = leaves[(id(weight), 1)]
    >>> leaf.is_leaf, leaf.requires_grad, leaf.data_ptr() == weight.data_ptr()
    (True, True, True)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipepar.program.units import ModelUnits

__all__ = ["Aliases", "alias_leaves", "of_stage", "used_elsewhere"]

Aliases = Mapping[tuple[int, int], Tensor]
"""The alias of each (weight ``id``, using stage) of a mini-batch."""


def used_elsewhere(
    lay: ModelUnits, stage_of_unit: Sequence[int], owner: Mapping[int, int], stages: Collection[int]
) -> dict[int, list[nn.Parameter]]:
    """Per stage of ``stages``, the weights its units use that another stage holds (``owner``:
    the holding stage of each weight, by ``id``), each once."""
    uses: dict[int, dict[int, nn.Parameter]] = {}
    for unit, s in zip(lay.units, stage_of_unit):
        if s not in stages:
            continue
        for p in unit.module.parameters():
            holder = owner.get(id(p))
            if holder is not None and holder != s:
                uses.setdefault(s, {})[id(p)] = p
    return {s: list(found.values()) for s, found in uses.items()}


def alias_leaves(
    uses: Mapping[int, Sequence[nn.Parameter]], devices: Sequence[torch.device]
) -> dict[tuple[int, int], Tensor]:
    """A fresh alias of each weight for each stage using it (``devices``: each stage's),
    needing a gradient when the weight does; made from the weights' current values."""
    leaves: dict[tuple[int, int], Tensor] = {}
    for s, params in uses.items():
        for p in params:
            with torch.no_grad():
                leaf = p.detach() if p.device == devices[s] else p.detach().to(devices[s])
            leaves[(id(p), s)] = leaf.requires_grad_(p.requires_grad)
    return leaves


def of_stage(
    uses: Mapping[int, Sequence[nn.Parameter]], leaves: Aliases, s: int
) -> list[tuple[nn.Parameter, Tensor]]:
    """Stage ``s``'s ``(weight, alias)`` pairs."""
    return [(p, leaves[(id(p), s)]) for p in uses.get(s, ())]
