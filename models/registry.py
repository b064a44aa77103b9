"""Look zoo models up by name (``models.get("alexnet")``), for the tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from models.alexnet import alexnet
from models.convnet import convnet
from models.gpt import gpt
from models.mlp import mlp
from models.resnet import resnet, resnet50
from models.vgg import vgg, vgg16

__all__ = ["get", "names"]

_BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "alexnet": alexnet,
    "convnet": convnet,
    "gpt": gpt,
    "mlp": mlp,
    "resnet": resnet,
    "resnet50": resnet50,
    "vgg": vgg,
    "vgg16": vgg16,
}


def names() -> list[str]:
    """Names that :func:`get` accepts, sorted.

    Example:
        >>> "alexnet" in names()
        True
    """
    return sorted(_BUILDERS)


def get(name: str, **kwargs: Any) -> nn.Sequential:
    """Build the zoo model called ``name`` (``"alexnet"`` or ``"models.alexnet"``).

    Args:
        name: A name from :func:`names`, optionally prefixed with ``models.``.
        **kwargs: Passed to the builder, e.g. ``num_classes=10`` or ``device="meta"``.

    Returns:
        The model as an ``nn.Sequential``.

    Raises:
        ValueError: ``name`` is not in the zoo.
        TypeError: A keyword the builder does not take.

    Example:
        >>> model = get("models.mlp", depth=2, width=8, device="meta")
        >>> len(model)
        4
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as 'alexnet', got {type(name).__name__}")
    key = name.removeprefix("models.")
    if key not in _BUILDERS:
        raise ValueError(f"name={name!r} is not in the model zoo; pass one of {names()}")
    try:
        return _BUILDERS[key](**kwargs)
    except TypeError as exc:
        raise TypeError(f"models.get({name!r}, ...): {exc}; see help(models.{key})") from exc
