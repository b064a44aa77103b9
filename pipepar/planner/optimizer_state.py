"""What an optimizer really allocates: its state per parameter and its step's temporaries.

No guess factors: the optimizer is built over ``meta`` copies of the parameters (same shapes and
dtypes, no memory), stepped twice, and its state tensors are counted; the second step runs under
a :class:`~pipepar.memory_tracker.MemoryTracker` to measure the step's temporaries. Optimizers
that cannot step on ``meta`` are stepped on small CPU copies instead. Figures are kept by
optimizer and parameter shapes, so a model's repeated layers (a transformer's blocks) and later
profiles of the same model step each kind of layer once.

    >>> spec = resolve_optimizer("adam")
    >>> cost = optimizer_cost(spec, [torch.empty(1024, device="meta")], foreach=False)
    >>> cost.state_bytes  # exp_avg + exp_avg_sq, fp32
    8192
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipepar.planner.memory_tracker import MemoryTracker

__all__ = ["OptimizerSpec", "OptimizerCost", "resolve_optimizer", "optimizer_cost"]

logger = logging.getLogger(__name__)

_NAMED: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {"lr": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "rmsprop": (torch.optim.RMSprop, {}),
}
# Largest parameter (elements) we are willing to copy to CPU for optimizers that reject meta.
_CPU_FALLBACK_LIMIT = 1 << 24


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build the optimizer whose memory we count.

    Attributes:
        name: a short name for reports ("adam", "SGD", "none").
        cls: the optimizer class, or None for "no optimizer state".
        kwargs: constructor arguments other than the parameters.
    """

    name: str
    cls: type[torch.optim.Optimizer] | None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerCost:
    """Optimizer memory for one group of parameters.

    Attributes:
        state_bytes: bytes of state tensors kept between steps (on the parameters' device).
        step_bytes: peak bytes of temporaries during ``step()`` beyond the state.
    """

    state_bytes: int
    step_bytes: int


def resolve_optimizer(optimizer: object) -> OptimizerSpec:
    """Turn the user's ``optimizer=`` argument into an :class:`OptimizerSpec`.

    Args:
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"sgd-momentum"``, ``"rmsprop"``, None
            (no state), a ``torch.optim.Optimizer`` subclass, or an optimizer instance (its
            class and ``defaults`` are reused).

    Returns:
        The spec.

    Example:
        >>> resolve_optimizer(torch.optim.SGD).name
        'SGD'
    """
    if optimizer is None or optimizer == "none":
        return OptimizerSpec("none", None)
    if isinstance(optimizer, str):
        key = optimizer.lower().replace("_", "-")
        if key not in _NAMED:
            raise ValueError(
                f"optimizer={optimizer!r} is not known; use one of {sorted(_NAMED)}, None, "
                "or a torch.optim.Optimizer subclass such as torch.optim.Adagrad"
            )
        cls, kwargs = _NAMED[key]
        return OptimizerSpec(key, cls, dict(kwargs))
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return OptimizerSpec(optimizer.__name__, optimizer, _required_defaults(optimizer))
    if isinstance(optimizer, torch.optim.Optimizer):
        defaults = {k: v for k, v in optimizer.defaults.items() if k != "params"}
        return OptimizerSpec(type(optimizer).__name__, type(optimizer), defaults)
    raise TypeError(
        f"optimizer must be a name like 'adam', None or a torch.optim.Optimizer subclass, "
        f"got {type(optimizer).__name__} {optimizer!r}"
    )


def _required_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    # Some optimizers (older SGD, custom ones) make lr a required argument; give them one.
    try:
        lr = inspect.signature(cls).parameters.get("lr")
    except (TypeError, ValueError):
        return {}
    return {"lr": 1e-3} if lr is not None and lr.default is inspect.Parameter.empty else {}


# Costs measured so far, by optimizer, its arguments, foreach and parameter shapes and dtypes.
_KNOWN: dict[tuple[object, ...], OptimizerCost] = {}
_KNOWN_LIMIT = 4096


def optimizer_cost(
    spec: OptimizerSpec, params: Sequence[torch.Tensor], *, foreach: bool | None = None
) -> OptimizerCost:
    """Measure state and step temporaries for ``params`` (only shapes and dtypes are used).

    Args:
        spec: from :func:`resolve_optimizer`.
        params: tensors shaped like the parameters that will be trained; any device.
        foreach: force the multi-tensor (True) or per-tensor (False) implementation when the
            optimizer has that switch; None leaves the optimizer's default for ``meta``.

    Returns:
        The :class:`OptimizerCost`; zeros for no parameters or ``spec.cls is None``.

    Example:
        >>> optimizer_cost(resolve_optimizer("sgd"), [torch.empty(8, device="meta")]).state_bytes
        0
    """
    if spec.cls is None or not params:
        return OptimizerCost(0, 0)
    kwargs = dict(spec.kwargs)
    if foreach is not None and "foreach" in _init_parameters(spec.cls):
        kwargs["foreach"] = foreach
    key = _key(spec.cls, kwargs, params)
    cost = _KNOWN.get(key)
    if cost is None:
        cost = _measure(spec.name, spec.cls, kwargs, params)
        if len(_KNOWN) >= _KNOWN_LIMIT:
            _KNOWN.clear()
        _KNOWN[key] = cost
    return cost


def _key(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], params: Sequence[torch.Tensor]
) -> tuple[object, ...]:
    # repr keeps unhashable arguments (lists, tensors) usable as a key; equal reprs step alike.
    args = tuple(sorted((name, repr(value)) for name, value in kwargs.items()))
    return (cls, args, tuple((tuple(p.shape), p.dtype) for p in params))


def _measure(
    name: str,
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    params: Sequence[torch.Tensor],
) -> OptimizerCost:
    try:
        return _step_and_count(cls, kwargs, params, torch.device("meta"))
    except (NotImplementedError, RuntimeError) as err:
        logger.debug("%s cannot step on meta (%s); stepping CPU copies", name, err)
    too_big = [tuple(p.shape) for p in params if p.numel() > _CPU_FALLBACK_LIMIT]
    if too_big:
        raise ValueError(
            f"optimizer {name} cannot run on the meta device and parameters of shape "
            f"{too_big[0]} are too big to copy to CPU to count its state; "
            "use optimizer='adam' (or another built-in) for planning, or optimizer=None"
        )
    return _step_and_count(cls, kwargs, params, torch.device("cpu"))


def _init_parameters(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def _step_and_count(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    params: Sequence[torch.Tensor],
    device: torch.device,
) -> OptimizerCost:
    copies = [_grad_copy(p, device) for p in params]
    opt = cls(copies, **kwargs)
    opt.step()  # creates the state
    state = sum(_state_bytes(opt.state[p], device) for p in copies)
    with MemoryTracker() as tracker:
        opt.step()  # a steady-state step: its temporaries are what we want
    return OptimizerCost(state_bytes=state, step_bytes=tracker.peak_bytes)


def _grad_copy(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    copy = torch.zeros(param.shape, dtype=param.dtype, device=device).requires_grad_(True)
    copy.grad = torch.zeros_like(copy)
    return copy


def _state_bytes(state: dict[str, Any], device: torch.device) -> int:
    # Only state on the parameters' device counts: Adam's step counter lives on the CPU even
    # for CUDA parameters, and is not in the device's memory.
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.device == device:
            total += value.untyped_storage().nbytes()
    return total
