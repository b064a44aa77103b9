"""Hand activations and gradients from one stage's device to the next.

Copies into a CUDA device are issued ``non_blocking``: PyTorch orders a CUDA-to-CUDA copy after
the work queued on both devices' current streams, so the producing stage's kernels finish before
the bytes move, and the host thread is free to launch the next micro-batch meanwhile. Copies to
the CPU block, because a non-blocking device-to-host copy could be read before it lands.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from pipepar.core.logs import debug_enabled
from pipepar.core.microbatch import Value, map_tensors

__all__ = ["move"]

_log = logging.getLogger(__name__)
_DEBUG = debug_enabled()


def _move_tensor(t: Tensor, device: torch.device) -> Tensor:
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type == "cuda")


def move(value: Value, device: torch.device, *, what: str = "") -> Value:
    """Return ``value`` on ``device``; tensors already there are passed through untouched."""
    if _DEBUG:
        _log.debug("move %s to %s", what or "value", device)
    return map_tensors(value, lambda t: _move_tensor(t, device))
