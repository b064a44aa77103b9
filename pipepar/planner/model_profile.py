"""The planner's profile of any model: one :class:`~pipepar.planner.profile.LayerProfile` per unit.

:func:`profile_model` is :func:`pipepar.profile` for models that are not an ``nn.Sequential``:
the units of :func:`pipepar.units` take the place of the layers, so :func:`pipepar.plan` of the
result returns a balance over the units, which :func:`pipepar.wrap` takes as it is. The model's
own ``forward`` runs once on the sample (:mod:`pipepar.planner.unit_trace`, and
:mod:`pipepar.planner.unit_timing` for times on a real device): every figure is that of the
unit that was computing, code between two units counting with the one before.
Activations count at the unit that created them (as :class:`~pipepar.planner.profile.
LayerProfile` has it for layers); each storage once. A unit without parameters (a dropout, a
rotary table) has its own figures here, though the pipe computes it on the stage of the unit
before it when a stage would begin there: a small difference, as such units are cheap.

On ``meta`` nothing is allocated and nothing is timed, so a model no machine here could hold
plans in seconds; data-dependent checks a model makes (transformers' "is the mask all ones?")
are answered as for a batch without padding (:class:`~pipepar.meta.values.MetaScalars`)
and attention is counted as the fused kernels keep it.

    >>> model = zoo.llama3_70b()                      # on meta
    >>> ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    >>> prof = profile_model(model, dict(input_ids=ids, labels=ids))
    >>> pipepar.plan(prof, devices=8, capacity="80GiB", chunks=8, optimizer="adam").balance
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching.calls import as_call, batch_size
from pipepar.core.untouched import untouched
from pipepar.meta.fallback import MetaUnsupported
from pipepar.meta.values import SHADOW_LIMIT, meta_modes
from pipepar.planner.deferred_grads import DeferredGrads
from pipepar.planner.layer_trace import LayerTrace
from pipepar.planner.optimizer_state import OptimizerSpec, optimizer_cost, resolve_optimizer
from pipepar.planner.profile import (
    LayerProfile,
    ParamSpec,
    Profile,
    check_device,
    training_step,
    usable,
)
from pipepar.planner.profile import profile as profile_layers
from pipepar.planner.unit_timing import time_units
from pipepar.planner.unit_trace import UnitCall, deferred_units, trace_units
from pipepar.program import units as units_

__all__ = ["meta_forward", "profile", "profile_model"]

logger = logging.getLogger(__name__)

_META = torch.device("meta")


def profile(
    model: nn.Module,
    sample: Any,
    *,
    device: str | torch.device = "meta",
    optimizer: object = "adam",
) -> Profile:
    """Measure each layer's memory (and time, on real devices) for one training step: an
    ``nn.Sequential`` by its layers (:func:`pipepar.planner.profile.profile`), any other model
    (transformers, timm, torchvision as they are) by its units (:func:`profile_model`).

    Args:
        model: the model, not modified.
        sample: an input batch, dim 0 the batch: a tensor or a tuple of tensors; for a model
            other than an ``nn.Sequential`` also a dict of keyword arguments (e.g.
            ``dict(input_ids=ids, labels=ids)``).
        device: ``"meta"`` (no memory used, no times), ``"cpu"`` or a CUDA device.
        optimizer: whose state to count: ``"adam"``, ``"adamw"``, ``"sgd"``,
            ``"sgd-momentum"``, ``"rmsprop"``, None, or a ``torch.optim.Optimizer`` subclass.

    Returns:
        The :class:`~pipepar.planner.profile.Profile` of the whole sample batch, ready for
        :func:`pipepar.plan` and :mod:`pipepar.report`.

    Raises:
        ValueError: a forward that writes a weight in place, an uninitialized lazy module,
            or an ``optimizer`` name it does not know.
        RuntimeError: on ``meta``, an operation whose output shapes depend on values the
            ``meta`` device does not have (a router's choice of experts read as a shape),
            naming the operation and the module: profile on a real device.

    Example:
        >>> ids = torch.randint(1, 128, (4, 16))
        >>> prof = pipepar.profile(zoo.llama(layers=2), dict(input_ids=ids, labels=ids))
        >>> [layer.name for layer in prof.layers][:3]
        ['model.embed_tokens', 'model.rotary_emb', 'model.layers.0']
        >>> plan = pipepar.plan(prof, devices=2, capacity="1GiB")
    """
    if isinstance(model, nn.Sequential):
        return profile_layers(model, sample, device=device, optimizer=optimizer)
    return profile_model(model, sample, device=device, optimizer=optimizer)


def profile_model(
    model: nn.Module,
    sample: Any,
    *,
    device: str | torch.device | None = None,
    optimizer: object = None,
) -> Profile:
    """Measure each unit's memory (and time, on real devices) for one training step.

    The model is not modified: it runs with stand-ins for its parameters (the parameters
    themselves when already on ``device``, else copies; ``meta`` copies cost nothing) through
    ``torch.func.functional_call``, and gradients are returned, not accumulated into ``.grad``.

    Args:
        model: any ``nn.Module``; its units are :func:`pipepar.units` ``(model, sample)``.
        sample: an example call: a tensor, a tuple of positional arguments or a dict of keyword
            arguments, the batch on dimension 0 (e.g. ``dict(input_ids=ids, labels=ids)``; a
            model that returns a loss is differentiated from it, else from its outputs).
        device: ``"meta"`` (no memory used, no times), ``"cpu"`` or a CUDA device; None
            profiles where the model's parameters are.
        optimizer: whose state to count (see :func:`pipepar.profile`); None for none
            (:func:`pipepar.plan` counts the one it is given either way).

    Returns:
        The :class:`~pipepar.planner.profile.Profile`: layer ``i`` is unit ``i``, named by its
        module path; a parameter used by several units counts at the first (tied weights).

    Raises:
        TypeError: ``model`` is not a module or ``sample`` holds no tensor.
        ValueError: an unknown device or optimizer, or a model that fails on the sample.

    Example:
        >>> prof = profile_model(zoo.gpt2(layers=2), zoo.sample("gpt2", batch=4), device="meta")
        >>> [layer.name for layer in prof.layers][:3]
        ['transformer.wte', 'transformer.wpe', 'transformer.drop']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, but got {type(model).__name__}; pass the model itself"
        )
    target = check_device(device if device is not None else _where(model))
    spec = resolve_optimizer(optimizer)
    args, kwargs = _check_sample(sample)
    # Each run starts from the model as passed; afterwards it is as passed (untouched).
    with training_step(), untouched(model) as passed:
        args, kwargs = pytree.tree_map(usable, (args, kwargs))
        call = _unit_call(model, args, kwargs, target)
        lay = units_.model_units(model, _call_order(call))
        passed.restore()
        call = _with_layout(call, model, lay)
        traces, records = _checked(lambda: trace_units(call), model, call)
        passed.restore()
        deferred = _deferred(call, model, lay, args, kwargs, passed.restore)
        passed.restore()
        times = time_units(call) if target.type != "meta" else None
    costs, trained = _parameter_costs(model, lay, spec)
    saved = [0] * len(lay.units)
    for r in records:
        if r.saved and r.creator >= 0:
            saved[r.creator] += r.nbytes
    layers = [
        _layer(i, unit, traces[i], costs[i], times[i] if times else None, deferred[i], saved[i])
        for i, unit in enumerate(lay.units)
    ]
    kept = [r for r in records if r.saved or r.last_output is not None]
    logger.debug("profiled %d units on %s (%d storages kept)", len(layers), target, len(kept))
    return Profile(
        layers=layers,
        device=str(target),
        optimizer=spec.name,
        batch_size=batch_size(call.args, call.kwargs),
        input_shape=_input_shape(call),
        input_bytes=sum(r.nbytes for r in records if r.creator == -1),
        storages=kept,
        trained=trained,
    )


def _where(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _check_sample(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = as_call(sample)
    if not any(isinstance(t, Tensor) and t.dim() > 0 for t in pytree.tree_leaves((args, kwargs))):
        raise TypeError(
            f"sample must hold a tensor with the batch on dimension 0, got "
            f"{type(sample).__name__}; pass e.g. sample=dict(input_ids=ids, labels=ids) or "
            "sample=torch.randn(8, 3, 224, 224)"
        )
    return args, kwargs


def _unit_call(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> UnitCall:
    """The call with the model's parameters and the sample on ``device`` (units not yet known)."""
    pairs: list[tuple[Tensor, Tensor]] = []

    def move(value: Any) -> Any:
        moved = _moved(value, device)
        if device.type == "meta" and isinstance(value, Tensor):
            known = _known_value(value)
            if known is not None:
                pairs.append((moved, known))
        return moved

    moved_args, moved_kwargs = pytree.tree_map(move, (args, kwargs))
    stand = _stand_ins(model, device)
    return UnitCall(model, [], stand, {}, moved_args, moved_kwargs, device, pairs)


def _known_value(t: Tensor) -> Tensor | None:
    """The value a meta profile gives a sample tensor when the model reads it: its own, or
    for integer and boolean tensors given on meta, ones (token id 1, masks set: a batch
    without padding); None for large or floating-point meta tensors (never read)."""
    if t.numel() > SHADOW_LIMIT:
        return None
    if not t.is_meta:
        return t.detach().to("cpu", copy=True)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return None
    return torch.ones(t.shape, dtype=t.dtype)


def _with_layout(call: UnitCall, model: nn.Module, lay: units_.ModelUnits) -> UnitCall:
    """``call`` with the units and the unit holding each stand-in parameter."""
    holder = units_.owners(lay, list(range(len(lay.units))))
    owner = {}
    for name, p in model.named_parameters():
        owner[id(call.params[name])] = holder.get(id(p), 0)
    call.units, call.owner = [u.module for u in lay.units], owner
    return call


def _deferred(
    call: UnitCall,
    model: nn.Module,
    lay: units_.ModelUnits,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fresh: Callable[[], None],
) -> list[DeferredGrads]:
    """What each unit's split backward keeps for W, measured on meta (sizes only), or on
    ``call``'s real device where the model's code cannot run on meta (an operation whose
    outputs' shapes depend on activations: a router's choice of experts); ``fresh()`` puts
    the model back as it was passed before that second run."""
    if call.device.type == "meta":
        return deferred_units(call)
    try:
        return deferred_units(_with_layout(_unit_call(model, args, kwargs, _META), model, lay))
    except MetaUnsupported as err:
        logger.info("split backwards measured on %s: %s", call.device, err)
        fresh()
        return deferred_units(call)


def _stand_ins(model: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """Parameters (as ``nn.Parameter``, which the cut recognizes) and buffers to run the model
    with on ``device``: its own parameters when already there, else copies; buffers always
    copied, as training-mode layers (batch norm) update them in place. A tied parameter is
    listed once, under its first name (``functional_call`` ties the others to it)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if p.device == device:
            out[name] = p
        else:
            out[name] = nn.Parameter(_moved(p.detach(), device), requires_grad=p.requires_grad)
    for name, b in model.named_buffers():
        out[name] = _moved(b, device)
    return out


def _moved(value: Any, device: torch.device) -> Any:
    if not isinstance(value, Tensor):
        return value
    if device.type == "meta":
        return torch.empty_like(value, device=device)
    return value.detach().to(device, copy=True)


def _call_order(call: UnitCall) -> list[str]:
    """Unit paths in the order the model calls them, from a forward of the sample without
    gradients, as :func:`pipepar.units` finds them (here with the stand-ins and on meta with
    its answers to data-dependent reads)."""
    from torch.func import functional_call

    units = units_.model_units(call.model).units

    def run() -> None:
        with meta_modes(call.device, call.values):
            functional_call(call.model, call.params, call.args, call.kwargs)

    return units_.call_order(call.model, units, run)


def _checked(fn: Any, model: nn.Module, call: UnitCall) -> Any:
    try:
        return fn()
    except (RuntimeError, TypeError, IndexError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        shapes = [
            tuple(t.shape)
            for t in pytree.tree_leaves((call.args, call.kwargs))
            if isinstance(t, Tensor)
        ]
        raise ValueError(
            f"{type(model).__name__} failed on a sample with tensors of shapes {shapes} on "
            f"{call.device}: {first}; check the sample (the model's own arguments, batch "
            "first), or profile on a real device (device='cpu') with a small batch"
        ) from err


def _parameter_costs(
    model: nn.Module, lay: units_.ModelUnits, spec: OptimizerSpec
) -> tuple[list[dict[str, int]], list[list[ParamSpec]]]:
    """Parameter, gradient and optimizer bytes per unit, each parameter at the unit that holds
    it (:func:`pipepar.program.units.owners`: a tied one at the first unit using it, a loose
    one at the first unit with parameters inside its holder)."""
    holder = units_.owners(lay, list(range(len(lay.units))))
    own: list[list[nn.Parameter]] = [[] for _ in lay.units]
    for p in model.parameters():  # each once
        own[holder.get(id(p), 0)].append(p)
    costs, trained = [], []
    for params in own:
        grads = [p for p in params if p.requires_grad]
        meta = [torch.empty(p.shape, dtype=p.dtype, device=_META) for p in grads]
        loop = optimizer_cost(spec, meta, foreach=False)
        multi = optimizer_cost(spec, meta, foreach=True)
        costs.append(
            {
                "params_bytes": sum(_nbytes(p) for p in params),
                "grads_bytes": sum(_nbytes(p) for p in grads),
                "optimizer_bytes": loop.state_bytes,
                "optimizer_step_bytes": loop.step_bytes,
                "optimizer_step_foreach_bytes": multi.step_bytes,
            }
        )
        trained.append([(tuple(p.shape), p.dtype) for p in grads])
    return costs, trained


def _layer(
    i: int,
    unit: units_.Unit,
    t: LayerTrace,
    costs: dict[str, int],
    times: tuple[float, float] | None,
    deferred: DeferredGrads,
    saved: int,
) -> LayerProfile:
    """Unit ``i``'s figures; ``saved``: bytes autograd keeps of the storages it created."""
    fwd, bwd = times if times is not None else (None, None)
    return LayerProfile(
        index=i,
        name=unit.path or "model",
        type_name=type(unit.module).__name__,
        output_shape=t.output_shape if t.output_shape is not None else (),
        activation_bytes=saved,
        output_bytes=t.output_bytes,
        forward_peak_bytes=t.forward_peak,
        backward_peak_bytes=t.backward_peak,
        backward_inner_bytes=t.backward_inner,
        forward_ms=fwd,
        backward_ms=bwd,
        modifies_input=t.modifies_input,
        reuses_grad=t.reuses_grad,
        backward_points=t.backward_points,
        retained_points=t.retained_points,
        deferred_grad_bytes=deferred.nbytes,
        keeps_incoming_grad=deferred.keeps_incoming,
        splits_backward=deferred.splits,
        generic_params=deferred.generic,
        direct_grad_bytes=deferred.direct_bytes,
        direct_saved_bytes=deferred.saved_bytes,
        direct_saved_input_bytes=deferred.saved_input_bytes,
        whole_direct_grad_bytes=deferred.whole_direct_bytes,
        split_input_peak_bytes=deferred.input_peak,
        largest_matrix=deferred.largest,
        **costs,
    )


def _input_shape(call: UnitCall) -> tuple[Any, ...]:
    tensors = [t for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, Tensor)]
    if len(tensors) == 1:
        return tuple(int(d) for d in tensors[0].shape)
    return tuple(tuple(int(d) for d in t.shape) for t in tensors)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def meta_forward(model: nn.Module, sample: Any) -> Callable[[], None]:
    """The forward of the whole ``sample`` for a model built on ``meta``, as the profile runs
    it there: the sample moved to meta, with answers to its data-dependent reads (token ids,
    masks); call it under ``torch.no_grad()``."""
    from torch.func import functional_call

    args, kwargs = _check_sample(sample)
    call = _unit_call(model, args, kwargs, _META)

    def run() -> None:
        with meta_modes(call.device, call.values):
            functional_call(call.model, call.params, call.args, call.kwargs)

    return run
