"""A profile as one rank of a sharded data-parallel group holds it (``dp_shard=True``).

With ``pipepar.distributed.wrap(..., dp=n, dp_shard=True)`` each stage's parameters, their
gradients and the optimizer state are split over the stage's ``n`` data-parallel ranks (torch's
FSDP2 layout: dimension 0 of every tensor cut into ``n`` parts, the last ones padded). A step
gathers the stage's whole weights once, before its first action, and frees them after its last;
the gradients are summed whole over the micro-batches and reduce-scattered once. So a rank
holds, per layer:

- between steps: its shard of the weights, of their gradients and of the optimizer state;
- through a step, on top of that: the gathered weights and the whole gradient sums.

:func:`sharded` rewrites a profile's per-layer figures to those of one rank: parameters and
gradients count the whole tensors (held through the step) plus the shards, the optimizer state
and the optimizer step's temporaries only the shard's (computed for the shard's own shapes).
The peak of a step is then what :func:`pipepar.plan` predicts for it (``shard=n``); what a rank
keeps between steps is :func:`resident_bytes`.

    >>> one_rank = sharded(prof, 8)
    >>> one_rank.layers[0].optimizer_bytes < prof.layers[0].optimizer_bytes
    True
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from pipepar.planner.optimizer_state import optimizer_cost, resolve_optimizer
from pipepar.planner.profile import LayerProfile, ParamSpec, Profile

__all__ = ["check_shard", "resident_bytes", "shard_shape", "sharded"]


def check_shard(shard: object) -> int:
    """The shard group size: an int >= 1."""
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(
            f"shard={shard!r} must be an int >= 1: the data-parallel ranks each stage's state is "
            "split over (1: replicated, as with dp_shard=False)"
        )
    return shard


def shard_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of one rank's part of a tensor of ``shape`` cut into ``n`` along dimension 0
    (the largest part: FSDP2 pads the others to it).

    Example:
        >>> shard_shape((10, 4), 4)
        (3, 4)
    """
    if not shape:
        return shape
    return (math.ceil(shape[0] / n), *shape[1:])


def sharded(profile: Profile, n: int) -> Profile:
    """``profile`` as one rank of a shard group of ``n`` holds it (see the module docstring);
    ``profile`` itself for ``n == 1``."""
    n = check_shard(n)
    if n == 1:
        return profile
    specs = profile.trained or [[] for _ in profile.layers]
    layers = [
        _layer(layer, trained, profile.optimizer, n)
        for layer, trained in zip(profile.layers, specs)
    ]
    return replace(profile, layers=layers, shard=n)


def resident_bytes(profile: Profile, n: int) -> int:
    """What one rank of a shard group of ``n`` keeps between steps, for the unsharded
    ``profile``: its shards of the weights, their gradients and the optimizer state."""
    n = check_shard(n)
    specs = profile.trained or [[] for _ in profile.layers]
    total = 0
    for layer, trained in zip(profile.layers, specs):
        params, grads, state = _shares(layer, trained, profile.optimizer, n)
        total += params + grads + state[0]
    return total


def _layer(layer: LayerProfile, trained: list[ParamSpec], optimizer: str, n: int) -> LayerProfile:
    params, grads, (state, loop_step, multi_step) = _shares(layer, trained, optimizer, n)
    return replace(
        layer,
        params_bytes=layer.params_bytes + params,
        grads_bytes=layer.grads_bytes + grads,
        optimizer_bytes=state,
        optimizer_step_bytes=loop_step,
        optimizer_step_foreach_bytes=multi_step,
    )


def _shares(
    layer: LayerProfile, trained: list[ParamSpec], optimizer: str, n: int
) -> tuple[int, int, tuple[int, int, int]]:
    """One rank's shard of the layer's weights and gradients (bytes), and the optimizer's state
    and step temporaries over the shards."""
    shards = tuple((shard_shape(tuple(s), n), d) for s, d in trained)
    trained_bytes = sum(math.prod(s) * d.itemsize for s, d in trained)
    grads = sum(math.prod(s) * d.itemsize for s, d in shards)
    frozen = max(layer.params_bytes - trained_bytes, 0)
    whole = (
        layer.optimizer_bytes,
        layer.optimizer_step_bytes,
        layer.optimizer_step_foreach_bytes,
    )
    return grads + math.ceil(frozen / n), grads, _optimizer(shards, optimizer, whole, n)


@functools.lru_cache(maxsize=1024)
def _optimizer(
    shards: tuple[ParamSpec, ...], optimizer: str, whole: tuple[int, int, int], n: int
) -> tuple[int, int, int]:
    """The optimizer's state and step temporaries over the shards (their own shapes); a
    profile's optimizer known only by a name this cannot resolve again: its figures ``whole``
    (state, step, multi-tensor step) / n. Cached: a model's repeated layers (a transformer's
    blocks) and a search's many shapes of one model measure each kind of layer once."""
    try:
        spec = resolve_optimizer(optimizer)
    except (TypeError, ValueError):
        spec = None
    if spec is None or not shards:
        return (
            math.ceil(whole[0] / n),
            math.ceil(whole[1] / n),
            math.ceil(whole[2] / n),
        )
    tensors = [torch.empty(s, dtype=d, device="meta") for s, d in shards]
    loop = optimizer_cost(spec, tensors, foreach=False)
    multi = optimizer_cost(spec, tensors, foreach=True)
    return loop.state_bytes, loop.step_bytes, multi.step_bytes
