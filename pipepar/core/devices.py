"""Which device each stage runs on."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

__all__ = ["DeviceSpec", "resolve_devices", "to_device"]

DeviceSpec = None | int | Sequence[str | int | torch.device]


def to_device(spec: str | int | torch.device) -> torch.device:
    """Parse one device and check this machine has it."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"devices has {spec!r}, which torch does not know as a device ({error}); "
            "use names like 'cpu' or 'cuda:0'"
        ) from None
    if device.type == "cuda":
        _check_cuda(device)
    return device


def _check_cuda(device: torch.device) -> None:
    if not torch.cuda.is_available():
        raise ValueError(
            f"devices has {str(device)!r} but CUDA is not available on this machine; "
            "use devices=['cpu', 'cpu', ...] or run on a machine with GPUs"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"devices has {str(device)!r} but this machine has {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1}); pick one of those"
        )


def resolve_devices(devices: DeviceSpec, n_stages: int) -> list[torch.device]:
    """One device per stage.

    ``None`` means every CUDA device (one per stage), or the CPU for every stage on a machine
    without CUDA; an int ``n`` means the first ``n`` CUDA devices (``n`` CPU workers without
    CUDA); a sequence is used as given and must have at least one entry per stage.
    """
    if devices is None:
        if torch.cuda.is_available():
            devices = torch.cuda.device_count()
        else:
            return [torch.device("cpu")] * n_stages
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        count = int(devices)
        if count < 1:
            raise ValueError(f"devices={count} must be at least 1 device")
        devices = (
            [f"cuda:{i}" for i in range(count)] if torch.cuda.is_available() else ["cpu"] * count
        )
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices must be a list of devices, an int or None, but got {devices!r}; "
            "e.g. devices=['cuda:0', 'cuda:1'] or devices=['cpu', 'cpu']"
        )
    resolved = [to_device(d) for d in devices]
    if len(resolved) < n_stages:
        raise ValueError(
            f"balance has {n_stages} stages but only {len(resolved)} devices were given "
            f"({[str(d) for d in resolved]}); pass one device per stage (repeat 'cpu' to run "
            "several stages on the CPU) or use fewer stages"
        )
    return resolved[:n_stages]
