"""Count each layer's FLOPs on ``meta``, for step times of models no device here can run.

A profile on ``meta`` has sizes but no times. :func:`count_flops` runs the model once forward
and once forward and backward on ``meta`` under ``torch.utils.flop_counter.FlopCounterMode``,
which attributes each operator's FLOPs to the modules running it, backward included; a
layer's count is its module's (a profile's layer names are module paths: the child's name of
an ``nn.Sequential``, the unit's path for any model). FLOPs outside every layer (a loss computed
in the model's own ``forward``) count with the last layer. Only operators with a FLOP formula
count (matrix products, convolutions, attention); elementwise work counts nothing.

The pass runs under :func:`pipepar.meta.values.meta_modes`, as the profile of any model
does: a model's reads of its token ids or masks are answered from the sample's values, and
attention runs as the fused kernel does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from pipepar.core.untouched import untouched
from pipepar.meta.values import SHADOW_LIMIT, meta_modes
from pipepar.planner.profile import Profile

__all__ = ["count_flops"]

_META = torch.device("meta")


def count_flops(model: nn.Module, sample: Any, profile: Profile) -> list[tuple[float, float]]:
    """Per layer of ``profile``, the (forward, backward) FLOPs of one step on ``sample``.

    Nothing is computed and nothing allocated: the model runs on ``meta`` copies of its
    parameters and of the sample, and is left as it was (:func:`untouched`).

    Args:
        model: the model profiled (an ``nn.Sequential`` or any module).
        sample: the sample it was profiled with: a tensor, a tuple of positional arguments or
            a dict of keyword arguments, batch first.
        profile: its profile; the counts come in the order of its layers.

    Raises:
        ValueError: the model does not run on ``meta`` (it reads the value of a weight or an
            activation), or a layer's name is no module of the model.

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> x = torch.randn(32, 64)
        >>> count_flops(model, x, pipepar.profile(model, x))[0]
        (262144.0, 262144.0)
    """
    root = type(model).__name__
    keys = [_key(model, root, layer.name) for layer in profile.layers]
    params = _stand_ins(model)
    args, kwargs, known = _meta_call(sample)

    def run(backward: bool) -> None:
        with meta_modes(_META, known):
            output = functional_call(model, params, args, kwargs)
            if backward:
                _backward(output, params)

    with untouched(model) as passed:  # each run from the model as passed, and left so
        forward = _counts(lambda: run(False), model)
        passed.restore()
        both = _counts(lambda: run(True), model)
    out = [(forward.get(k, 0), both.get(k, 0) - forward.get(k, 0)) for k in keys]
    extra_f = max(0, forward.get("Global", 0) - sum(f for f, _ in out))
    extra_b = max(0, both.get("Global", 0) - forward.get("Global", 0) - sum(b for _, b in out))
    out[-1] = (out[-1][0] + extra_f, out[-1][1] + extra_b)
    return [(float(f), float(b)) for f, b in out]


def _key(model: nn.Module, root: str, name: str) -> str:
    """The counter's name for the module at ``name`` (the whole model's unit is ``"model"``)."""
    try:
        model.get_submodule(name)
    except AttributeError:
        if name == "model":
            return root
        raise ValueError(
            f"layer {name!r} of the profile is no module of {root}; pass the model the profile "
            "was made from"
        ) from None
    return f"{root}.{name}" if name else root


def _stand_ins(model: nn.Module) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = nn.Parameter(torch.empty_like(p, device=_META), requires_grad=p.requires_grad)
    for name, b in model.named_buffers():
        out[name] = torch.empty_like(b, device=_META)
    return out


def _meta_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[Tensor, Tensor]]]:
    """The sample on meta, and the values a model may read of it (token ids, masks: small
    integer tensors, as the profile of any model knows them; ones when given on meta)."""
    args: tuple[Any, ...]
    if isinstance(sample, dict):
        args, kwargs = (), dict(sample)
    elif isinstance(sample, (tuple, list)):
        args, kwargs = tuple(sample), {}
    else:
        args, kwargs = (sample,), {}
    known: list[tuple[Tensor, Tensor]] = []

    def move(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        meta = torch.empty_like(value, device=_META)
        if not (value.dtype.is_floating_point or value.dtype.is_complex) and (
            value.numel() <= SHADOW_LIMIT
        ):
            real = torch.ones(value.shape, dtype=value.dtype) if value.is_meta else value.cpu()
            known.append((meta, real))
        return meta

    moved_args, moved_kwargs = pytree.tree_map(move, (args, kwargs))
    return moved_args, moved_kwargs, known


def _backward(output: Any, params: dict[str, Tensor]) -> None:
    """Differentiate the step's loss (an output's ``loss``, else the sum of its outputs)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, Tensor):
        leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn]
        loss = sum((t.float().sum() for t in leaves), torch.zeros((), device=_META))
    trained = [p for p in params.values() if p.requires_grad]
    if trained and loss.grad_fn is not None:
        torch.autograd.grad(loss, trained, allow_unused=True)


def _attention(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return sdpa_flop_count(q, k, v)


def _attention_backward(
    grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return sdpa_backward_flop_count(grad, q, k, v)


_ATTENTION = {
    # The fused kernel meta attention runs as (pipepar.meta.values), which the counter
    # has no formula for; it counts as the other fused kernels do.
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
}


def _counts(run: Any, model: nn.Module) -> dict[str, int]:
    counter = FlopCounterMode(display=False, custom_mapping=_ATTENTION)
    try:
        with counter:
            run()
    except (RuntimeError, NotImplementedError, TypeError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{type(model).__name__} does not run on meta to count its FLOPs: {first}; profile "
            "on a real device for measured times instead"
        ) from err
    return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
