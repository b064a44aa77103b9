"""The devices a plan targets: their names, capacities and how the optimizer runs on them.

Devices are only described, never used, so a plan may target GPUs this machine does not have.

    >>> [t.name for t in resolve_targets(["cuda:0", "cuda:1"], "80GiB", layers=8)]
    ['cuda:0', 'cuda:1']
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipepar.core.units import format_bytes, parse_bytes

__all__ = ["Target", "resolve_targets"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One device of the plan.

    Attributes:
        name: e.g. ``"cuda:0"``, ``"cpu"`` or ``"device 3"`` (a device known only by count).
        capacity: bytes it can hold, or None for unlimited.
        foreach: whether torch's optimizers use their multi-tensor kernels there (CUDA, and
            devices known only by count, which are most likely GPUs), which need more
            temporary memory in the step than the per-tensor loop used on CPU.
    """

    name: str
    capacity: int | None
    foreach: bool


def resolve_targets(
    devices: int | Sequence[str | int | torch.device] | None,
    capacity: int | str | Sequence[int | str | None] | None,
    *,
    layers: int,
) -> list[Target]:
    """Describe each device of the plan.

    Args:
        devices: a count, names (``"cuda:1"``, ``torch.device("cpu")``, or a CUDA index like
            ``1``), or None (the CUDA devices here, or one CPU).
        capacity: bytes for all devices (int or ``"80GiB"``), one entry per device, or None.
        layers: the number of layers; there cannot be more stages than layers.

    Returns:
        One :class:`Target` per device.

    Example:
        >>> resolve_targets(2, "1GiB", layers=4)[0].capacity
        1073741824
    """
    names, types = _devices(devices)
    if len(names) > layers:
        raise ValueError(
            f"devices={devices!r} asks for {len(names)} stages but the model has {layers} "
            f"layers; use at most {layers} devices"
        )
    caps = _capacities(capacity, names, types)
    return [Target(n, c, t != "cpu") for n, c, t in zip(names, caps, types)]


def _devices(devices: object) -> tuple[list[str], list[str]]:
    """(names, types); type "any" for devices known only by count."""
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        count = int(devices)
        if count < 1:
            raise ValueError(f"devices={count} must be at least 1; give the number of devices")
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count <= here:
            return [f"cuda:{i}" for i in range(count)], ["cuda"] * count
        return [f"device {i}" for i in range(count)], ["any"] * count
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices must be a count, a list of device names or None, got {devices!r}; "
            "e.g. devices=4 or devices=['cuda:0', 'cuda:1']"
        )
    if not devices:
        raise ValueError("devices is empty; give at least one device")
    parsed = []
    for i, d in enumerate(devices):
        try:
            parsed.append(torch.device(d))
        except (RuntimeError, TypeError):
            raise ValueError(
                f"devices[{i}]={d!r} is not a torch device name; use e.g. 'cuda:0' or 'cpu'"
            ) from None
    return [str(d) for d in parsed], [d.type for d in parsed]


def _capacities(capacity: object, names: list[str], types: list[str]) -> list[int | None]:
    if isinstance(capacity, Sequence) and not isinstance(capacity, str):
        if len(capacity) != len(names):
            raise ValueError(
                f"capacity has {len(capacity)} entries but there are {len(names)} devices; "
                "give one capacity per device, or one value for all"
            )
        given = [
            None if c is None else parse_bytes(c, name=f"capacity[{i}]")
            for i, c in enumerate(capacity)
        ]
    elif capacity is None:
        given = [None] * len(names)
    else:
        given = [parse_bytes(capacity, name="capacity")] * len(names)  # type: ignore[arg-type]
    return [c if c is not None else _default_capacity(n, t) for c, n, t in zip(given, names, types)]


def _default_capacity(name: str, kind: str) -> int | None:
    """A CUDA device's total memory when it exists here; unlimited otherwise."""
    if kind != "cuda" or not torch.cuda.is_available():
        return None
    device = torch.device(name)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    total = int(torch.cuda.get_device_properties(index).total_memory)
    logger.debug("capacity of %s: %s (its total memory)", name, format_bytes(total))
    return total
