"""Build a model from a name, for the command line: zoo, torchvision or ``package.module:function``.

    >>> load_model("models.alexnet", device="meta")            # the zoo (models/)
    >>> load_model("resnet50", device="meta")                  # torchvision, weights=None
    >>> load_model("torchvision.models.vgg16", device="meta")
    >>> load_model("mypackage.nets:build", device="meta", depth=4)

Builders run under ``torch.device(device)`` so that ``device="meta"`` allocates nothing; those
that take ``device=`` or ``weights=`` get ``device`` and ``weights=None`` (no downloads). The
result is flattened with :func:`pipepar.sequentialize` unless it is an ``nn.Sequential``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["load_model", "resolve_builder"]


def resolve_builder(spec: str) -> Callable[..., Any]:
    """The callable that ``spec`` names.

    Args:
        spec: ``"package.module:function"`` (attribute path after the colon), a dotted path
            ``"package.module.function"``, or a bare torchvision model name (``"resnet50"``).

    Returns:
        The builder.

    Raises:
        ValueError: nothing by that name.

    Example:
        >>> resolve_builder("torchvision.models:resnet18").__name__
        'resnet18'
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"MODEL {spec!r} is empty; use e.g. models.alexnet or resnet50")
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        return _attribute(_import(module_name, spec), attr, spec)
    if "." in spec:
        module_name, _, attr = spec.rpartition(".")
        return _attribute(_import(module_name, spec), attr, spec)
    return _torchvision(spec)


def _import(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(
            f"MODEL {spec!r}: cannot import {name!r} ({err}); check the name and that the "
            "package is installed (and importable from the current directory)"
        ) from None


def _attribute(module: Any, path: str, spec: str) -> Callable[..., Any]:
    obj = module
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"MODEL {spec!r}: {getattr(obj, '__name__', obj)!s} has no {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"MODEL {spec!r} is a {type(obj).__name__}, not something to call")
    return obj  # type: ignore[no-any-return]


def _torchvision(name: str) -> Callable[..., Any]:
    try:
        import torchvision.models as tvm
    except ImportError:
        raise ValueError(
            f"MODEL {name!r} looks like a torchvision model but torchvision is not installed; "
            "pip install torchvision, or use models.<name> or package.module:function"
        ) from None
    available = tvm.list_models()
    if name not in available:
        close = [m for m in available if name.lower() in m][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"MODEL {name!r} is not a torchvision model{hint}; use models.<name> for the zoo "
            "or package.module:function"
        )

    def build(**kw: Any) -> nn.Module:
        return tvm.get_model(name, **{"weights": None, **kw})  # never download

    return build


def load_model(spec: str, *, device: str | torch.device = "meta", **kwargs: Any) -> nn.Sequential:
    """Build the model ``spec`` names on ``device`` and return it as an ``nn.Sequential``.

    Args:
        spec: see :func:`resolve_builder`.
        device: where to build it (``"meta"`` allocates nothing).
        **kwargs: passed to the builder.

    Returns:
        The model, flattened to an ``nn.Sequential``.

    Example:
        >>> len(load_model("models.mlp", device="meta", depth=2))
        4
    """
    builder = resolve_builder(spec)
    params = _parameters(builder)
    if "weights" in params and "weights" not in kwargs:
        kwargs["weights"] = None  # never download
    if "device" in params and "device" not in kwargs:
        kwargs["device"] = device
    with torch.device(device):
        model = builder(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL {spec!r} returned a {type(model).__name__}, not an nn.Module")
    if isinstance(model, nn.Sequential):
        return model
    from pipepar.core.sequential import sequentialize

    return sequentialize(model)  # type: ignore[no-any-return]


def _parameters(builder: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(builder).parameters)
    except (TypeError, ValueError):
        return set()
