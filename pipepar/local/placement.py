"""``to(device)``, ``cuda()`` and ``cpu()`` on a pipe of one process: a pipe places its stages
itself, so these are no-ops where every stage is on the target already (HF Trainer and
accelerate call them on any model they get) and errors where a stage would move
(:class:`~pipepar.pipe.Pipe`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_staying", "cuda_device"]


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
