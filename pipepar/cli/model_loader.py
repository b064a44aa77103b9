"""Build a model from a name, for the command line: ``pipepar.zoo``, torchvision or
``package.module:function``.

    >>> load_model("pipepar.zoo:alexnet", device="meta")       # pipepar's examples (pipepar.zoo)
    >>> load_model("resnet50", device="meta")                  # torchvision, weights=None
    >>> load_model("torchvision.models.vgg16", device="meta")
    >>> load_model("mypackage.nets:build", device="meta", depth=4)
    >>> load_module("pipepar.zoo:llama3_70b", device="meta")   # kept as it is
    >>> load_hf_config("path/to/config.json", device="meta")               # transformers

Builders run under ``torch.device(device)`` so that ``device="meta"`` allocates nothing; those
that take ``device=`` or ``weights=`` get ``device`` and ``weights=None`` (no downloads).
:func:`load_model` flattens the result with :func:`pipepar.sequentialize` unless it is an
``nn.Sequential`` (``pipepar profile``); :func:`load_module` keeps the model as it is, to be
laid out in units (``pipepar plan``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["load_hf_config", "load_model", "load_module", "resolve_builder"]


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
        raise ValueError(f"MODEL {spec!r} is empty; use e.g. pipepar.zoo:alexnet or resnet50")
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
            "package is installed or in the current directory (pipepar's example models are "
            "pipepar.zoo:NAME)"
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
            f"MODEL {name!r} looks like a torchvision model but torchvision is not installed"
            f"{_zoo_hint(name)}; pip install torchvision, or use pipepar.zoo:NAME or "
            "package.module:function"
        ) from None
    available = tvm.list_models()
    if name not in available:
        close = [m for m in available if name.lower() in m][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else _zoo_hint(name)
        raise ValueError(
            f"MODEL {name!r} is not a torchvision model{hint}; use pipepar.zoo:NAME for "
            "pipepar's example models or package.module:function"
        )

    def build(**kw: Any) -> nn.Module:
        return tvm.get_model(name, **{"weights": None, **kw})  # never download

    return build


def _zoo_hint(name: str) -> str:
    """A pointer to ``pipepar.zoo:name`` where a bare name is one of pipepar's examples."""
    from pipepar import zoo

    return f" (pipepar's example is pipepar.zoo:{name})" if name in zoo.__all__ else ""


def load_model(spec: str, *, device: str | torch.device = "meta", **kwargs: Any) -> nn.Sequential:
    """Build the model ``spec`` names on ``device`` and return it as an ``nn.Sequential``.

    Args:
        spec: see :func:`resolve_builder`.
        device: where to build it (``"meta"`` allocates nothing).
        **kwargs: passed to the builder.

    Returns:
        The model, flattened to an ``nn.Sequential``.

    Example:
        >>> len(load_model("pipepar.zoo:mlp", device="meta", depth=2))
        4
    """
    model = load_module(spec, device=device, **kwargs)
    if isinstance(model, nn.Sequential):
        return model
    from pipepar.core.sequential import sequentialize

    return sequentialize(model)  # type: ignore[no-any-return]


def load_module(spec: str, *, device: str | torch.device = "meta", **kwargs: Any) -> nn.Module:
    """Build the model ``spec`` names on ``device``, as it is (not flattened).

    Args:
        spec: see :func:`resolve_builder`.
        device: where to build it (``"meta"`` allocates nothing).
        **kwargs: passed to the builder.

    Example:
        >>> type(load_module("pipepar.zoo:llama", layers=2)).__name__
        'LlamaForCausalLM'
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
    return model


def load_hf_config(
    path: str, *, device: str | torch.device = "meta", **overrides: Any
) -> nn.Module:
    """A transformers model built from a local ``config.json`` (or a folder holding one), with
    random weights: the class its ``architectures`` names, else a causal LM (else the base
    model) for its ``model_type``. Nothing is downloaded; the cache is off (training).

    Args:
        path: the ``config.json`` file or its folder.
        device: where to build it (``"meta"`` allocates nothing).
        **overrides: config fields to change, e.g. ``num_hidden_layers=2``.

    Example:
        >>> load_hf_config("llama-3-70b/config.json", device="meta")
    """
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"--hf-config {path!r} needs transformers, which is not installed; "
            "pip install transformers"
        ) from None
    config = _hf_config(transformers, path, overrides)
    cls = _hf_class(transformers, config, path)
    with torch.device(device):
        model = cls(config) if isinstance(cls, type) else cls.from_config(config)
    return model  # type: ignore[no-any-return]


def _hf_config(transformers: Any, path: str, overrides: dict[str, Any]) -> Any:
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"--hf-config {path!r} is not a transformers config ({first}); pass a local "
            "config.json (with its model_type) or the folder holding it"
        ) from None
    for key, value in {"use_cache": False, **overrides}.items():
        setattr(config, key, value)
    return config


def _hf_class(transformers: Any, config: Any, path: str) -> Any:
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in getattr(auto, "_model_mapping", {}):
            return auto
    raise ValueError(
        f"--hf-config {path!r}: transformers has no model for model_type "
        f"{getattr(config, 'model_type', None)!r}; name one in the config's architectures"
    )


def _parameters(builder: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(builder).parameters)
    except (TypeError, ValueError):
        return set()
