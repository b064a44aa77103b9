"""Where example models are built: on a given device, or on the meta device without memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["DeviceLike", "on_device"]

DeviceLike = torch.device | str | None


@contextlib.contextmanager
def on_device(device: DeviceLike) -> Iterator[None]:
    """Create every tensor made inside the block on ``device`` (``None``: torch's default).

    Building under ``torch.device("meta")`` allocates nothing, so a 100-billion parameter
    stack can be profiled and planned on a laptop.

    Args:
        device: Target device, e.g. ``"meta"``, ``"cpu"``, ``"cuda:0"``, or ``None``.

    Example:
        >>> with on_device("meta"):
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.device.type
        'meta'
    """
    if device is None:
        yield
        return
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a device torch knows; pass e.g. 'cpu', 'meta' or 'cuda:0'"
        ) from exc
    with target:
        yield
