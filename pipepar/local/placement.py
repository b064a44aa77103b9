"""``to(device)``, ``cuda()`` and ``cpu()`` on a pipe: a pipe places its stages itself, so these
are no-ops where every stage is on the target already (HF Trainer and accelerate call them on
any model they get) and errors where a stage would move (:class:`StaysPlaced`, the base of
:class:`~pipepar.pipe.Pipe` and of :class:`~pipepar.distributed.pipe.DistributedPipe`, whose
other ranks' weights are on ``meta`` and could not move at all)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["StaysPlaced", "check_staying", "cuda_device"]


class StaysPlaced(nn.Module):
    """A module whose stages stay where it placed them (:meth:`stage_devices`): ``to(device)``,
    ``cuda()`` and ``cpu()`` check the target (:func:`check_staying`) and move nothing; the
    rest of a ``to`` (dtype, memory format) converts as usual."""

    def stage_devices(self) -> Sequence[torch.device]:
        """The devices of the stages this module computes."""
        raise NotImplementedError

    def to(self, *args: Any, **kwargs: Any) -> StaysPlaced:  # type: ignore[override]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            check_staying("to(device)", self.stage_devices(), device)
        rest: dict[str, Any] = {"dtype": dtype, "memory_format": memory_format}
        rest = {k: v for k, v in rest.items() if v is not None}
        return super().to(**rest, non_blocking=non_blocking) if rest else self

    def cuda(self, device: Any = None) -> StaysPlaced:  # type: ignore[override]
        check_staying("cuda()", self.stage_devices(), cuda_device(device))
        return self

    def cpu(self) -> StaysPlaced:
        check_staying("cpu()", self.stage_devices(), torch.device("cpu"))
        return self


def check_staying(call: str, devices: Sequence[torch.device], target: torch.device) -> None:
    """Nothing where every stage in ``devices`` is on ``target`` already; a ValueError naming
    ``call`` (``"to(device)"``, ``"cuda()"``, ``"cpu()"``) where a stage would move."""
    wanted = _exact(target)
    if any(_exact(d) != wanted for d in devices):
        raise _moving_denied(call, devices, target)


def _moving_denied(call: str, devices: Sequence[torch.device], target: torch.device) -> ValueError:
    return ValueError(
        f"pipe.{call} would move the stages on {[str(d) for d in devices]} to {target}; a pipe "
        f"places its stages itself, so this is a no-op only where every stage is on {target} "
        "already. Pass devices=[...] to pipepar.wrap to place the stages (or move the model "
        "before wrapping it); to(dtype) is allowed"
    )


def _exact(device: torch.device) -> torch.device:
    """``cuda`` names the current CUDA device (where CUDA is available); ``cpu:0`` is the CPU
    (accelerate under torchrun names it so)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def cuda_device(device: int | str | torch.device | None) -> torch.device:
    """The device ``nn.Module.cuda(device)`` moves to."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device("cuda" if device is None else device)
