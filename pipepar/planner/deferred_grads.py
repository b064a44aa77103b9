"""What a split backward keeps for W: the gradients each layer's weight work starts from.

Zero-bubble schedules split a stage's backward (:mod:`pipepar.core.split_backward`): B computes
the gradient of the stage input and records, at every place where a path to the parameters
leaves the input path (a *junction*: the ``addmm`` of a Linear, a LayerNorm, an embedding), the
gradient arriving there; W later restarts autograd from those gradients. Until W runs, the
micro-batch holds them on top of its activations (B retains the graph), about 11 hidden-sized
tensors for a transformer block: more than the block's saved activations. The planner needs
their size per layer; it is read here from the very split the runtime does, run layer by layer
on ``meta`` (sizes only, no memory, whatever device the profile is for).

This module only measures; when W runs and what is alive then is the schedule's business
(:mod:`pipepar.planner.peak_moments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from pipepar.core.split_backward import backward_input
from pipepar.planner.layer_trace import stand_ins
from pipepar.planner.memory_tracker import storage_key

__all__ = ["DeferredGrads", "deferred_grads"]

_META = torch.device("meta")


@dataclass(frozen=True)
class DeferredGrads:
    """What layer ``i``'s split backward keeps until its W, for the whole sample batch.

    Attributes:
        nbytes: bytes of the gradients recorded for W, each storage once.
        keeps_incoming: whether one of them is the gradient that came into the layer.
        splits: False when the layer's backward cannot be split (a parameter reached along two
            paths): the runtime then runs the stage's whole backward in B.
    """

    nbytes: int
    keeps_incoming: bool
    splits: bool


def deferred_grads(layers: Sequence[nn.Module], sample: Any) -> list[DeferredGrads]:
    """Split each layer's backward as a pipeline stage of that one layer would, on ``meta``.

    Args:
        layers: the model's layers, called in order on the previous output.
        sample: the first layer's input (any device; only shapes and dtypes are used).

    Example:
        >>> [d.nbytes for d in deferred_grads([nn.Linear(8, 4)], torch.ones(2, 8))]
        [32]
    """
    x = _to_meta(sample)
    found = []
    for layer in layers:
        leaves = _leaves(x)
        params = stand_ins(layer, _META)
        with torch.enable_grad():  # on copies: an in-place layer must not write into a leaf
            out = functional_call(layer, params, (_copies(leaves),))
        found.append(_split(out, leaves, [p for p in params.values() if p.requires_grad]))
        x = _detach(out)
    return found


def _split(out: Any, leaves: Any, weights: list[torch.Tensor]) -> DeferredGrads:
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs:
        return DeferredGrads(0, False, True)
    incoming = [torch.ones_like(t) for t in outs]
    inputs = [t for t in _tensors(leaves) if t.requires_grad]
    if any(t.grad_fn is None for t in outs):  # the runtime runs such a stage unsplit
        return DeferredGrads(0, False, False)
    _, work = backward_input(outs, incoming, inputs, weights)
    if work is None:
        return DeferredGrads(0, False, False)
    kept: dict[int, int] = {}
    for grads in work.grads.values():
        for g in grads:
            if g is not None:
                kept[storage_key(g)] = g.untyped_storage().nbytes()
    for _, g in work.roots:
        kept[storage_key(g)] = g.untyped_storage().nbytes()
    came_in = {storage_key(g) for g in incoming}
    return DeferredGrads(sum(kept.values()), bool(came_in & kept.keys()), True)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device=_META)
    return tuple(_to_meta(v) for v in value) if isinstance(value, (tuple, list)) else value


def _leaves(value: Any) -> Any:
    """Fresh leaves, as a stage receives them: floating-point ones require grad."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    return tuple(_leaves(v) for v in value) if isinstance(value, tuple) else value


def _copies(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad else value
    return tuple(_copies(v) for v in value) if isinstance(value, tuple) else value


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return tuple(_detach(v) for v in value) if isinstance(value, (tuple, list)) else value
