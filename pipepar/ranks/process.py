"""The process group a pipeline across ranks runs in, and this rank's device
(:class:`~pipepar.distributed.pipe.DistributedPipe`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["ensure_process_group", "resolve_device"]


def ensure_process_group() -> None:
    """Initialize the default process group from torchrun's environment (NCCL with CUDA, else
    gloo) where none exists yet; a ValueError outside torchrun."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "torch.distributed is not initialized and RANK/WORLD_SIZE are not set; launch with "
            "torchrun, or call torch.distributed.init_process_group(...) before wrap()"
        )
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def resolve_device(
    device: torch.device | str | None, group: dist.ProcessGroup | None
) -> torch.device:
    """This rank's device: ``device``, else ``cuda:LOCAL_RANK`` on NCCL, else the CPU; a CUDA
    device becomes the current one."""
    if device is not None:
        resolved = torch.device(device)
    elif "nccl" in str(dist.get_backend(group)):
        resolved = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        )
    else:
        resolved = torch.device("cpu")
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    return resolved
