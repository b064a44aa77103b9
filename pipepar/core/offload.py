"""Activation offload: what a micro-batch's forward saved for its backward waits in host memory.

Between a micro-batch's forward on a stage and its backward there, the stage keeps what the
forward's operations saved for the gradients (most of a stage's memory under 1F1B: stage 0
holds K micro-batches' worth). A micro-batch whose backward is many actions away need not keep
them on the device: :class:`ActivationStore` copies each saved tensor to host memory as the
forward saves it (``torch.autograd.graph.saved_tensors_hooks``) and lets the device copy go;
:meth:`ActivationStore.reload` brings a micro-batch's tensors back ahead of its backward, at
the action the schedule names (:mod:`pipepar.core.offload_plan`), so the copy overlaps the
compute in between.

On CUDA the copies run on a side stream into pinned host memory: the device memory of a tensor
sent out is not reused before its copy has run (``record_stream``), and a backward reading a
reloaded tensor waits for its copy (an event). Anywhere else there is no separate host memory;
the store does the same bookkeeping with plain copies (a *stand-in*), so the schedule's
offload and reload points and the numbers they give are tested without a GPU.

What goes out is memory, not tensors: a saved tensor's block of its storage (its own bytes, or
the whole storage for a view with gaps, such as attention's heads cut from one projection), and
a block goes out once however many saved tensors view it (a tensor saved twice, the same
output saved as itself and reshaped); each comes back as a view of the one copy, with its own
strides, so the backward computes exactly as from what never left, and the memory it holds is
what the forward's storages held. What is not sent out: the stage's own weights and views of
them (they stay on the device anyway), blocks of fewer than ``min_bytes`` bytes, and storages
still referenced when the forward returns (the stage's input and output, a module's cache):
copying those would free nothing.

Counts (bytes sent out, reloaded on time, reloaded late by the backward itself, the largest
sum resident at once) are kept in :class:`OffloadCounts`.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["ActivationStore", "OffloadCounts", "Pack"]

Pack = Callable[[Tensor], Tensor]
"""A saved-tensor pack hook that returns the tensor to save in place of another."""

MIN_BYTES = 1 << 16
"""Tensors smaller than this (64 KiB) stay on the device: their copy costs more than it frees."""


@dataclass
class OffloadCounts:
    """What a store moved, in bytes and in tensors (summed over the store's lifetime)."""

    sent: int = 0
    """Bytes copied to host memory."""
    tensors: int = 0
    """Blocks of memory copied to host memory (one per storage, however many saved tensors
    view it)."""
    reloaded: int = 0
    """Bytes brought back ahead of their backward (by :meth:`ActivationStore.reload`)."""
    late: int = 0
    """Bytes a backward had to bring back itself (no reload was asked in time)."""
    resident: int = 0
    """Bytes of sent-out tensors on the device now: while their forward runs, and from their
    reload to their release."""
    peak_resident: int = 0
    """The largest :attr:`resident` seen."""


@dataclass(eq=False)
class _Sent:
    """One block of a storage's bytes while it is away: its host copy and, once reloaded, the
    device one. Every saved tensor that views the block unpacks from it (:class:`_View`)."""

    host: Tensor
    """The block's bytes (``uint8``) in host memory."""
    device: torch.device
    start: int
    """Where the block begins in the original storage, in bytes."""
    nbytes: int
    storage: weakref.ref[torch.UntypedStorage] | None
    """The original storage while the forward runs (to find later views of it)."""
    views: int = 0
    """How many of the saved tensors that view it autograd still holds."""
    back: torch.UntypedStorage | None = None
    """The device copy (or the original, kept), held by the store while autograd holds a
    saved tensor that views it: as long as the original would have lived."""
    ready: Any = None  # a CUDA event the reload recorded; None on the stand-in
    kept: bool = False  # still referenced when the forward returned: never left the device

    def holds(self, lo: int, hi: int, itemsize: int) -> bool:
        """Whether bytes ``lo..hi`` of the storage lie in the block, at a whole element of
        ``itemsize`` bytes from its start (a view of it can be rebuilt on the copy)."""
        inside = self.start <= lo and hi <= self.start + self.nbytes
        return inside and (lo - self.start) % itemsize == 0


@dataclass(frozen=True)
class _View:
    """A saved tensor as a view of a block away: rebuilt on the block's device copy."""

    sent: _Sent
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Its first element in the original storage, in bytes."""

    def on(self, storage: torch.UntypedStorage) -> Tensor:
        """The view on ``storage``: the block's copy (which begins at ``start``), or the
        original storage itself (a block kept)."""
        shift = 0 if self.sent.kept else self.sent.start
        itemsize = self.dtype.itemsize
        empty = torch.empty(0, dtype=self.dtype, device=storage.device)
        return empty.set_(storage, (self.offset - shift) // itemsize, self.shape, self.stride)


@dataclass
class _MicroBatch:
    sent: list[_Sent] = field(default_factory=list)
    by_storage: dict[int, list[_Sent]] = field(default_factory=dict)


class ActivationStore:
    """The saved tensors of one stage's micro-batches, sent to host memory and brought back.

    Args:
        device: the stage's device.
        weights: the stage's parameters and buffers (never sent out, nor views of them).
        min_bytes: the smallest tensor sent out.

    Example:
        >>> lin = torch.nn.Linear(256, 256)
        >>> store = ActivationStore(torch.device("cpu"), lin.parameters(), min_bytes=0)
        >>> x = torch.randn(64, 256, requires_grad=True)
        >>> with store.saving(0):
        ...     loss = lin(x).relu().sum()
        >>> store.counts.tensors  # relu's result (the input x is still referenced)
        1
        >>> store.reload(0)
        >>> loss.backward()
        >>> store.release(0)
    """

    def __init__(
        self, device: torch.device, weights: Iterable[Tensor], *, min_bytes: int = MIN_BYTES
    ) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.counts = OffloadCounts()
        self._weights = {w.untyped_storage().data_ptr() for w in weights}
        self._batches: dict[int, _MicroBatch] = {}
        self._cuda = device.type == "cuda"
        self._side: Any = torch.cuda.Stream(device) if self._cuda else None

    # -- F: sending out -------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, i: int, first: Pack | None = None) -> Iterator[None]:
        """Send out what micro-batch ``i``'s forward saves inside the block; at its end, take
        back what is still referenced elsewhere (sending it out freed nothing). ``first``, the
        pack hook of an outer pair of saved-tensor hooks (only the innermost pair runs), is
        asked first: what it saves in place of a tensor stays as it is. What comes back lives
        as long as autograd holds a saved tensor that views it (a split backward's graph until
        its ``W``), as the original would have had it never left."""
        batch = self._batches.setdefault(i, _MicroBatch())
        start = len(batch.sent)

        def pack(t: Tensor) -> Tensor | _View:
            if first is not None:
                instead = first(t)
                if instead is not t:
                    return instead
            return self._pack(batch, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        for sent in batch.sent[start:]:
            self.counts.resident -= sent.nbytes
            original = sent.storage() if sent.storage is not None else None
            if original is not None:  # held elsewhere: use it, let the host copy go
                sent.back = original if sent.views > 0 else None
                sent.host, sent.kept = _EMPTY, True
                self.counts.sent -= sent.nbytes
                self.counts.tensors -= 1
            sent.storage = None
        batch.by_storage.clear()

    def _pack(self, batch: _MicroBatch, t: Tensor) -> Tensor | _View:
        if not self._sendable(t):
            return t
        storage = t.untyped_storage()
        lo, hi = _extent(t)
        blocks = batch.by_storage.setdefault(storage.data_ptr(), [])
        for sent in blocks:  # a view of a block already sent (the same storage, still alive)
            alive = sent.storage is not None and sent.storage() is storage
            if alive and sent.holds(lo, hi, t.element_size()):
                return self._view(sent, t)
        sent = _Sent(self._to_host(t, lo, hi), t.device, lo, hi - lo, weakref.ref(storage))
        self._resident(sent.nbytes)  # until the forward ends (on CUDA, until its copy has run)
        blocks.append(sent)
        batch.sent.append(sent)
        self.counts.sent += sent.nbytes
        self.counts.tensors += 1
        return self._view(sent, t)

    def _view(self, sent: _Sent, t: Tensor) -> _View:
        offset = int(t.storage_offset()) * t.element_size()
        view = _View(sent, t.dtype, tuple(t.shape), tuple(t.stride()), offset)
        sent.views += 1
        weakref.finalize(view, self._unviewed, sent)  # autograd let go of the saved tensor
        return view

    def _unviewed(self, sent: _Sent) -> None:
        """A saved tensor viewing ``sent`` is gone: the last one takes the device copy with it
        (the tensors the backward unpacked from it keep it while they live)."""
        sent.views -= 1
        if sent.views <= 0:
            sent.back = None

    def _sendable(self, t: Tensor) -> bool:
        if t.layout != torch.strided or t.device != self.device:
            return False
        lo, hi = _extent(t)
        return hi - lo >= self.min_bytes and t.untyped_storage().data_ptr() not in self._weights

    def _to_host(self, t: Tensor, lo: int, hi: int) -> Tensor:
        block = _bytes(t.untyped_storage(), lo, hi)
        if not self._cuda:
            return _outside_torch(block)
        host = torch.empty(hi - lo, dtype=torch.uint8, pin_memory=True)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(block, non_blocking=True)
        t.record_stream(side)  # its memory is not reused before the copy has run
        return host

    # -- B: bringing back -----------------------------------------------------------------------
    def reload(self, i: int) -> None:
        """Start bringing micro-batch ``i``'s tensors back to the device (no-op if none were
        sent out, or they are back already)."""
        batch = self._batches.get(i)
        if batch is None:
            return
        for sent in batch.sent:
            if sent.back is None and not sent.kept and sent.views > 0:
                self._bring_back(sent)
                self.counts.reloaded += sent.nbytes

    def _unpack(self, packed: Tensor | _View) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        sent = packed.sent
        back = sent.back
        if back is None:  # nobody asked in time (or it was freed): the backward waits
            back = self._bring_back(sent)
            self.counts.late += sent.nbytes
        view = packed.on(back)
        if sent.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(sent.ready)
            view.record_stream(stream)
            sent.ready = None
        return view

    def _bring_back(self, sent: _Sent) -> torch.UntypedStorage:
        host = sent.host
        if not self._cuda:
            back = torch.empty(sent.nbytes, dtype=torch.uint8)
            back.copy_(host)
        else:
            with torch.cuda.stream(self._side):
                back = host.to(sent.device, non_blocking=True)
                sent.ready = torch.cuda.Event()
                sent.ready.record(self._side)
        storage = back.untyped_storage()
        sent.back = storage
        self._resident(sent.nbytes)
        weakref.finalize(storage, self._freed, sent.nbytes)
        return storage

    def _resident(self, nbytes: int) -> None:
        self.counts.resident += nbytes
        self.counts.peak_resident = max(self.counts.peak_resident, self.counts.resident)

    def _freed(self, nbytes: int) -> None:
        self.counts.resident -= nbytes

    # -- after the last backward action ---------------------------------------------------------
    def release(self, i: int) -> None:
        """Micro-batch ``i``'s backward on the stage is done: forget its tensors."""
        batch = self._batches.pop(i, None)
        if batch is None:
            return
        for sent in batch.sent:
            sent.back, sent.host = None, _EMPTY

    def clear(self) -> None:
        """Forget every micro-batch (the mini-batch ended, or failed)."""
        for i in list(self._batches):
            self.release(i)


def _bytes(storage: torch.UntypedStorage, lo: int, hi: int) -> Tensor:
    """Bytes ``lo..hi`` of ``storage`` as a ``uint8`` tensor (no copy)."""
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return empty.set_(storage, lo, (hi - lo,), (1,))


def _outside_torch(block: Tensor) -> Tensor:
    """The stand-in's host copy of the bytes ``block``: in pages of its own (an anonymous
    ``mmap``), outside torch's CPU allocator and the C heap under it, so that what either
    counts as allocated drops as a GPU's would."""
    if block.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    host = torch.frombuffer(mmap.mmap(-1, block.numel()), dtype=torch.uint8)
    host.copy_(block)
    return host


def _extent(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage a saved tensor's copy must hold: its own block where it covers
    one without gaps or overlaps (in some order of its dimensions), else the whole storage (a
    slice with gaps, as attention's heads cut from one projection, or an expanded tensor:
    views of one storage saved apart then go out and come back as one block, as they were).

    Example:
        >>> x = torch.ones(4, 6)
        >>> [_extent(v) for v in (x, x.t(), x[1:], x[:, :3], torch.ones(3).expand(2, 3))]
        [(0, 96), (0, 96), (24, 96), (0, 96), (0, 12)]
    """
    start = int(t.storage_offset()) * t.element_size()
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return 0, t.untyped_storage().nbytes()
        expected *= size
    return start, start + int(t.numel()) * t.element_size()


_EMPTY = torch.empty(0)
