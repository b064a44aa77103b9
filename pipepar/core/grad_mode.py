"""Autograd's grad mode switched for a block, without the Python around ``torch.no_grad``.

``torch.no_grad()`` and ``torch.set_grad_enabled(mode)`` are decorators as well as contexts:
making one runs a chain of Python constructors, and entering and leaving it more calls, several
microseconds on a small host, once per action of every micro-batch. :class:`GradMode` is the
context alone: it reads the mode on entry, sets it, and puts it back on exit (as
``torch.set_grad_enabled`` does), through the same switch, ``torch._C._set_grad_enabled``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GradMode"]

_SET = torch._C._set_grad_enabled


class GradMode:
    """Grad mode ``enabled`` inside the block; the mode before it after.

    Example:
        >>> with GradMode(False):
        ...     torch.is_grad_enabled()
        False
        >>> torch.is_grad_enabled()
        True
    """

    __slots__ = ("_before", "enabled")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._before = True

    def __enter__(self) -> None:
        self._before = torch.is_grad_enabled()
        _SET(self.enabled)

    def __exit__(self, *exc: Any) -> None:
        _SET(self._before)
