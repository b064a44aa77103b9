"""Live-byte accounting that works on any device, ``meta`` included.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every aten op's outputs pass through it, so it
sees each new storage the moment it is created and, through a finalizer on the storage, the
moment it is freed. That is what lets the profiler measure a layer's forward and backward peaks
on the ``meta`` device, where no allocator exists to ask. Storages that an op only aliases (views,
in-place results, parameters) are not new and are not counted.

What it cannot see: scratch memory that a kernel allocates and frees inside one op (im2col
buffers, oneDNN scratchpads). On CUDA the profiler therefore prefers the caching allocator's own
counters (``torch.cuda.max_memory_allocated``).

    >>> with MemoryTracker() as tracker:
    ...     y = torch.nn.functional.relu(torch.ones(4, device="meta") * 2)
    >>> tracker.peak_bytes
    32
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "storage_key"]


def storage_key(tensor: torch.Tensor) -> int:
    """An id for the storage behind ``tensor``, equal for all views of one storage.

    Example:
        >>> x = torch.ones(4)
        >>> storage_key(x) == storage_key(x[1:])
        True
    """
    return int(tensor.untyped_storage()._cdata)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class MemoryTracker(TorchDispatchMode):
    """Count the bytes of storages created while active, and the peak of their live total.

    Attributes:
        live_bytes: bytes of tracked storages alive now.
        peak_bytes: the highest ``live_bytes`` since creation or the last :meth:`reset_peak`.
        on_new: optional callback ``(key, nbytes)`` run for every new storage (the profiler
            uses it to remember which layer created which storage).
        on_change: optional callback ``(key, delta)`` run after every change of ``live_bytes``
            (the profiler uses it to follow a backward as it frees activations and makes
            gradients).
    """

    def __init__(self, on_new: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.on_new = on_new
        self.on_change: Callable[[int, int], None] | None = None
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current live total."""
        self.peak_bytes = self.live_bytes

    def live_keys(self) -> set[int]:
        """The :func:`storage_key` of every tracked storage alive now."""
        return set(self._sizes)

    def is_tracked(self, key: int) -> bool:
        """Whether the storage with this :func:`storage_key` was created under this tracker."""
        return key in self._sizes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        inputs = {storage_key(t) for t in _tensors((args, kwargs)) if _has_storage(t)}
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            if _has_storage(tensor):
                self._add(tensor, inputs)
        return out

    def _add(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = int(storage._cdata)
        if key in inputs or key in self._sizes:
            return  # an alias of something that already exists: no new memory
        nbytes = int(storage.nbytes())
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        # Storages keep their Python object alive exactly as long as the C++ storage lives,
        # so a finalizer on it fires when the memory is released.
        weakref.finalize(storage, self._free, key)
        if self.on_new is not None:
            self.on_new(key, nbytes)
        if self.on_change is not None:
            self.on_change(key, nbytes)

    def _free(self, key: int) -> None:
        nbytes = self._sizes.pop(key, 0)
        self.live_bytes -= nbytes
        if nbytes and self.on_change is not None:
            self.on_change(key, -nbytes)


def _has_storage(tensor: torch.Tensor) -> bool:
    # Sparse and some wrapper subclasses have no plain storage; they are not counted.
    return tensor.layout == torch.strided and not tensor.is_nested
