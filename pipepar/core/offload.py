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

What is not sent out: the stage's own weights and views of them (they stay on the device
anyway), tensors of fewer than ``min_bytes`` bytes, tensors that are not dense, and tensors
still referenced when the forward returns (the stage's input and output, a module's cache):
copying those would free nothing. A tensor saved twice is sent once.

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
    """Tensors copied to host memory."""
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
    """One saved tensor while it is away: its host copy and, once reloaded, the device one."""

    host: Tensor
    device: torch.device
    nbytes: int
    original: weakref.ref[Tensor] | None
    hold: bool
    """Whether the device copy stays until the micro-batch's release (a split backward's W
    reads it again after B); otherwise it lives as long as autograd uses it."""
    uses: int = 1
    """How many times the forward saved it (a backward unpacks each once)."""
    back: Tensor | None = None
    """The device copy, held by the store (until its last use, or the release)."""
    used: weakref.ref[Tensor] | None = None
    """The device copy once autograd took it (freed when autograd is done with it)."""
    ready: Any = None  # a CUDA event the reload recorded; None on the stand-in
    kept: bool = False  # still referenced when the forward returned: never left the device


@dataclass
class _MicroBatch:
    hold: bool
    sent: list[_Sent] = field(default_factory=list)
    by_id: dict[int, tuple[weakref.ref[Tensor], _Sent]] = field(default_factory=dict)


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
    def saving(self, i: int, first: Pack | None = None, *, hold: bool = False) -> Iterator[None]:
        """Send out what micro-batch ``i``'s forward saves inside the block; at its end, take
        back what is still referenced elsewhere (sending it out freed nothing). ``first``, the
        pack hook of an outer pair of saved-tensor hooks (only the innermost pair runs), is
        asked first: what it saves in place of a tensor stays as it is. ``hold``: a tensor
        brought back stays until :meth:`release` (the backward reads it more than once, as a
        split backward's ``W`` does after its ``B``); otherwise it is freed as soon as autograd
        is done with it, as it would be had it never left."""
        batch = self._batches.setdefault(i, _MicroBatch(hold))
        start = len(batch.sent)

        def pack(t: Tensor) -> Tensor | _Sent:
            if first is not None:
                instead = first(t)
                if instead is not t:
                    return instead
            return self._pack(batch, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        for sent in batch.sent[start:]:
            self.counts.resident -= sent.nbytes
            original = sent.original() if sent.original is not None else None
            if original is not None:  # held elsewhere: use it, let the host copy go
                sent.back, sent.host, sent.kept = original, _EMPTY, True
                self.counts.sent -= sent.nbytes
                self.counts.tensors -= 1
            sent.original = None
        batch.by_id.clear()

    def _pack(self, batch: _MicroBatch, t: Tensor) -> Tensor | _Sent:
        if not self._sendable(t):
            return t
        seen = batch.by_id.get(id(t))
        if seen is not None and seen[0]() is t:
            seen[1].uses += 1
            return seen[1]
        nbytes = t.numel() * t.element_size()
        sent = _Sent(self._to_host(t), t.device, nbytes, weakref.ref(t), batch.hold)
        self._resident(nbytes)  # until the forward ends (on CUDA, until its copy has run)
        batch.by_id[id(t)] = (weakref.ref(t), sent)
        batch.sent.append(sent)
        self.counts.sent += nbytes
        self.counts.tensors += 1
        return sent

    def _sendable(self, t: Tensor) -> bool:
        return (
            t.layout == torch.strided
            and t.device == self.device
            and t.numel() * t.element_size() >= self.min_bytes
            and t.untyped_storage().data_ptr() not in self._weights
            and _dense(t)
        )

    def _to_host(self, t: Tensor) -> Tensor:
        if not self._cuda:
            return _outside_torch(t)
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
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
            if _on_device(sent) is None:
                self._bring_back(sent)
                self.counts.reloaded += sent.nbytes

    def _unpack(self, packed: Tensor | _Sent) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        back = _on_device(packed)
        if back is None:  # nobody asked in time (or it was freed): the backward waits
            back = self._bring_back(packed)
            self.counts.late += packed.nbytes
        if packed.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(packed.ready)
            back.record_stream(stream)
            packed.ready = None
        packed.uses -= 1
        if packed.uses <= 0 and not packed.hold and not packed.kept:
            # Its last use: autograd frees it when done, as it would had it never left.
            packed.used, packed.back = weakref.ref(back), None
        return back

    def _bring_back(self, sent: _Sent) -> Tensor:
        host = sent.host
        if not self._cuda:
            back = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype)
            back.copy_(host)
        else:
            with torch.cuda.stream(self._side):
                back = host.to(sent.device, non_blocking=True)
                sent.ready = torch.cuda.Event()
                sent.ready.record(self._side)
        sent.back, sent.used = back, None
        self._resident(sent.nbytes)
        weakref.finalize(back, self._freed, sent.nbytes)
        return back

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
            sent.back, sent.used, sent.host = None, None, _EMPTY

    def clear(self) -> None:
        """Forget every micro-batch (the mini-batch ended, or failed)."""
        for i in list(self._batches):
            self.release(i)


def _outside_torch(t: Tensor) -> Tensor:
    """The stand-in's host copy of ``t``: in pages of its own (an anonymous ``mmap``), outside
    torch's CPU allocator and the C heap under it, so that what either counts as allocated
    drops as a GPU's would. The copy has the strides of ``t`` (dense, see :func:`_dense`)."""
    size = t.numel() * t.element_size()
    if size == 0:
        return torch.empty(0, dtype=t.dtype).as_strided(t.shape, t.stride())
    flat = torch.frombuffer(mmap.mmap(-1, size), dtype=t.dtype)
    host = flat.as_strided(t.shape, t.stride())
    host.copy_(t.detach())
    return host


def _dense(t: Tensor) -> bool:
    """Whether ``t`` covers a block of memory without gaps or overlaps (in some order of its
    dimensions): a copy then keeps its strides, so the backward computes exactly as from the
    original. Others (a slice with gaps, an expanded tensor) stay on the device.

    Example:
        >>> x = torch.ones(4, 6)
        >>> _dense(x), _dense(x.t()), _dense(x[:, :3]), _dense(torch.ones(3).expand(2, 3))
        (True, True, False, False)
    """
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _on_device(sent: _Sent) -> Tensor | None:
    """The device copy of ``sent`` if there is one now (held, or still in autograd's use)."""
    if sent.back is not None:
        return sent.back
    return sent.used() if sent.used is not None else None


_EMPTY = torch.empty(0)
