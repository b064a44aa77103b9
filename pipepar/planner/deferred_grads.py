"""What a split backward keeps for W: the gradients each layer's weight work starts from.

Zero-bubble schedules split a stage's backward (:mod:`pipepar.core.split_backward`): B computes
the gradient of the stage input and records, at every place where a path to the parameters
leaves the input path (a *junction*: the ``addmm`` of a Linear, a LayerNorm, an embedding), the
gradient arriving there; W later restarts autograd from those gradients. Until W runs, the
micro-batch holds them on top of its activations (B retains the graph), about 11 hidden-sized
tensors for a transformer block: more than the block's saved activations. The planner needs
their size per layer; it is read here from the very split the runtime does, run layer by layer
on ``meta`` (sizes only, no memory, whatever device the profile is for).

The same split says which parameters take the *direct* route (a matrix product's weight
gradient made from the saved input and the recorded gradient, ``grad^T @ input``; a
LayerNorm's weight and bias from its own backward kernel on what it saved): from a stage's
second micro-batch on a product's gradients are summed in place (``addmm_``), so no temporary
exists for them; and when nothing is left for the generic route, B does not keep the graph:
the micro-batch then waits for W with only the recorded gradients and what the direct terms
read (products' saved inputs, norms' inputs and statistics). An unsplit backward takes the
direct route too (products only: it runs a norm's kernel anyway), but only on a stage with a
weight matrix of at least ``2**17`` elements (:class:`pipepar.core.step.StageStep`); its terms
come from the plan of a whole backward (``plan_backward(reach=True)``).

The same run gives B's own peak (:attr:`DeferredGrads.input_peak`): B frees what the forward
saved as it goes, except what W reads (the products' saved inputs) and the gradients it
records, which a whole backward frees as soon as it used them. Neither the points of a whole
backward nor those of one keeping its graph describe that (a transformer block's B holds its
MLP's hidden activation while the GELU's gradient is made: a whole backward had freed it).

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

from pipepar.core.split_backward import BackwardWalk, plan_backward, run_input
from pipepar.planner.layer_trace import stand_ins
from pipepar.planner.memory_tracker import MemoryTracker, storage_key

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
        generic: how many parameters W computes with autograd again (if any, B keeps the
            graph).
        direct_bytes: gradient bytes of the parameters a split W sums in place (matrix
            products; a bias's ``grad.sum(0)`` is still a temporary).
        saved_bytes: the direct products' saved inputs, each storage once: what a micro-batch
            keeps for W besides the recorded gradients when B does not keep the graph.
        saved_input_bytes: the part of ``saved_bytes`` that is the layer's input.
        whole_direct_bytes: ``direct_bytes`` of an unsplit backward.
        largest: elements of the largest weight matrix: with ``2**17`` or more, a stage holding
            the layer takes the direct route in an unsplit backward too.
        input_peak: the most bytes B of the layer holds beyond what was alive before its
            incoming gradient (that gradient included; what it freed of the forward's
            storages taken off); 0 where not measured.
    """

    nbytes: int
    keeps_incoming: bool
    splits: bool
    generic: int = 0
    direct_bytes: int = 0
    saved_bytes: int = 0
    saved_input_bytes: int = 0
    whole_direct_bytes: int = 0
    largest: int = 0
    input_peak: int = 0


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
        copies = _copies(leaves)
        # Tracked from the forward on: B's frees of what it saved count.
        with MemoryTracker() as tracker:
            with torch.enable_grad():  # on copies: an in-place layer must not write into a leaf
                out = functional_call(layer, params, (copies,))
            weights = [p for p in params.values() if p.requires_grad]
            found.append(_split(out, leaves, weights, copies=copies, tracker=tracker))
        x = _detach(out)
    return found


def _split(
    out: Any,
    leaves: Any,
    weights: list[torch.Tensor],
    *,
    copies: Any = None,
    tracker: MemoryTracker | None = None,
) -> DeferredGrads:
    """The split of one layer's backward; ``copies``: what the layer ran on, if not ``leaves``;
    ``tracker``: one active since the layer's forward, to measure B's peak."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    large = max((p.numel() for p in weights if p.dim() == 2), default=0)
    if not outs:
        return DeferredGrads(0, False, True, largest=large)
    incoming = [torch.ones_like(t) for t in outs]
    inputs = [t for t in _tensors(leaves) if t.requires_grad]
    if any(t.grad_fn is None for t in outs):  # the runtime runs such a stage unsplit
        return DeferredGrads(0, False, False, largest=large)
    whole = _in_place(plan_backward(outs, incoming, inputs, weights, reach=True))
    plan = plan_backward(outs, incoming, inputs, weights)
    direct, saved = _in_place(plan), _saved(plan)
    start = 0
    if tracker is not None:  # from before the incoming gradient
        start = tracker.live_bytes - sum(_nbytes(g) for g in incoming)
        tracker.reset_peak()
    _, work = run_input(plan, outs, incoming, inputs)
    peak = tracker.peak_bytes - start if tracker is not None else 0
    if work is None:
        return DeferredGrads(0, False, False, whole_direct_bytes=whole, largest=large)
    kept: dict[int, int] = {}
    for grads in work.grads.values():
        for g in grads:
            if g is not None:
                kept[storage_key(g)] = g.untyped_storage().nbytes()
    for _, g in work.roots:
        kept[storage_key(g)] = g.untyped_storage().nbytes()
    came_in = {storage_key(g) for g in incoming}
    layer_input = {storage_key(t) for t in _tensors(leaves if copies is None else copies)}
    generic = {id(p) for _, params in work.junctions for p in params}
    generic |= {id(p) for p in work.root_params} if work.roots else set()
    return DeferredGrads(
        sum(kept.values()),
        bool(came_in & kept.keys()),
        True,
        generic=len(generic),
        direct_bytes=direct,
        saved_bytes=sum(saved.values()),
        saved_input_bytes=sum(n for key, n in saved.items() if key in layer_input),
        whole_direct_bytes=whole,
        largest=large,
        input_peak=peak,
    )


def _in_place(plan: BackwardWalk) -> int:
    """Gradient bytes of the parameters whose every direct term is a matrix product: once
    their sum exists, the product adds into it and no temporary is made."""
    bias = {id(t.param) for t in plan.work.direct if t.saved is None}
    return sum(_nbytes(p) for p in plan.direct_params() if id(p) not in bias)


def _saved(plan: BackwardWalk) -> dict[int, int]:
    """What the direct terms read of the forward (products' saved inputs, norms' inputs and
    statistics): storage -> bytes."""
    return {
        storage_key(kept): kept.untyped_storage().nbytes()
        for t in plan.work.direct
        for kept in t.kept()
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
