"""What an operation makes on ``meta`` when its meta kernel cannot say.

Following a model on ``meta`` (a rank's shadow of another rank's stages, a profile) needs each
operation's outputs' shapes and dtypes. Two kinds of operations have no meta kernel that gives
them:

- data-dependent ones (``nonzero``, ``masked_select``, indexing with a boolean mask, ``unique``):
  their outputs' shapes are their inputs' values. Where every input's value is known
  (:class:`~pipepar.meta.values.MetaScalars` follows the values of token ids, masks,
  positions and constants), the operation runs on those values on the CPU and its outputs'
  shapes (and values) are theirs: masks built from the batch take the path a real run takes;
- kernels whose meta version is stricter than the device's: ``grouped_mm`` (transformers'
  mixture-of-experts layers) refuses ``float32`` on meta because CUDA's kernel does, though
  the CPU computes it. The meta kernel runs once more with the floating-point inputs in
  ``bfloat16``, which changes no shape, and the outputs take back the inputs' dtype.

What neither answers (a data-dependent operation on activations: a router's choice of experts
read on another rank's stage) raises :class:`MetaUnsupported`, naming the operation and the
innermost module running it, instead of torch's own message about meta kernels.

Why answers made where the operation runs, rather than values asked of the rank that computes
them: both answers here depend only on what every rank has (the batch, constants, shapes), so
every rank following the code makes the same one, with no message and no wait, and a profile
gets them as a shadow does. A value from another rank would need that rank to know, before it
computes, which of its operations a follower cannot make: it runs them for real, never on meta,
so it cannot tell without running its stage twice (and a stage's code has effects: a key-value
cache grows on each run). That remaining case is the error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MetaUnsupported", "module_running", "without_meta_kernel"]

_LOW = (torch.bfloat16, torch.float16)
"""Floating dtypes a stricter meta kernel is tried with."""


class MetaUnsupported(RuntimeError):
    """An operation whose outputs the ``meta`` device cannot make here."""


def without_meta_kernel(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_cpu: Callable[[Any], Any] | None,
    error: Exception,
) -> Any:
    """The meta outputs of ``func(*args, **kwargs)``, whose meta kernel raised ``error``.

    Args:
        func: an aten operation given meta tensors.
        args, kwargs: its arguments.
        on_cpu: the arguments with each meta tensor replaced by its known CPU value (raises
            when one has none), or None when no value is known.
        error: what the meta kernel raised.

    Raises:
        MetaUnsupported: neither the known values nor another dtype give the outputs.
        Exception: ``error`` itself, when no argument is on ``meta``.
    """
    if not any(t.is_meta for t in _flat((args, kwargs))):
        raise error
    if on_cpu is not None:
        try:
            a, k = on_cpu(args), on_cpu(kwargs)
        except Exception:  # an input whose value is not known
            pass
        else:
            return _to_meta(func(*a, **k))
    dtype = _floating(args, kwargs)
    if dtype is not None and dtype not in _LOW:
        for low in _LOW:
            try:
                out = func(*_cast(args, low), **_cast(kwargs, low))
            except Exception:  # the next dtype, then the error below
                continue
            return _cast(out, dtype)
    raise MetaUnsupported(_described(func, error)) from error


def _described(func: Any, error: Exception) -> str:
    text = str(error).strip()
    first = text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(error).__name__
    where = module_running()
    inside = f" in {where}" if where else ""
    return (
        f"the operation {func}{inside} cannot run on the meta device ({first}): its outputs' "
        "shapes depend on values not known there (an activation's), or it has no meta "
        "kernel. pipepar follows on meta the stages of other ranks, and profiles on meta; "
        "run this module in one process (pipepar.wrap), profile on a real device "
        "(device='cpu'), or make its code decide no shape from an activation's values"
    )


def module_running(frame: FrameType | None = None) -> str | None:
    """The innermost module whose code the caller runs, by its path in the outermost one
    running (e.g. ``"model.layers.1.mlp (MixtralSparseMoeBlock)"``), or None outside any."""
    frame = frame if frame is not None else sys._getframe(1)
    modules: list[nn.Module] = []
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not modules or modules[-1] is not owner):
            modules.append(owner)
        frame = frame.f_back
    if not modules:
        return None
    inner, root = modules[0], modules[-1]
    path = next((name for name, m in root.named_modules() if m is inner), "")
    return f"{path or type(root).__name__} ({type(inner).__name__})"


def _floating(args: Any, kwargs: Any) -> torch.dtype | None:
    """The dtype the floating-point tensors among the arguments promote to, or None."""
    found = [t for t in _flat((args, kwargs)) if t.is_floating_point()]
    if not found:
        return None
    dtype = found[0].dtype
    for t in found[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _flat(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    return []


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with each floating-point tensor in it in ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if type(value) in (tuple, list):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to("meta")
    if type(value) in (tuple, list):
        return type(value)(_to_meta(v) for v in value)
    return value
