"""Same-host messages through shared memory: a pipeline's point-to-point traffic between CPU
ranks of one machine, without gloo's sockets.

gloo moves each message through the loopback TCP stack and a transport thread on both ranks,
whose CPU time the ranks' own work pays for (about 0.3 ms per 128 KiB activation on a 2-core
VM). Ranks of one host instead each map one file of ``/dev/shm`` that holds a byte ring per
neighbouring rank writing into it and a doorbell word:

- a send copies its message (a small header, then the bytes) into the peer's ring as far as
  there is room; the rest waits in an outbox and moves on whenever this rank waits for
  anything, so a send never blocks;
- a receive reads its rings in order: a message goes straight into the receive posted for its
  channel, or into a stash until that receive is posted. Messages keep their order per
  channel (peer, group, tag), as gloo's do;
- a rank with nothing to do sleeps on its doorbell (a futex), which a peer rings after writing
  into its ring or reading from the peer's own.

It serves the pairs of neighbouring pipeline positions (the only ones that exchange
activations and gradients) that can open each other's file, for CPU tensors, on x86-64 Linux
(whose stores are seen in program order, so the rings' counters need no fences). Every other
pair, tensor or platform stays on gloo. Closing the mesh marks this rank's file closed and rings
its peers, so a peer blocked on it wakes with an error; a peer that died without closing is
noticed within :data:`_SLICE` seconds. ``PIPEPAR_SHARED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from pipepar.core import switches

__all__ = ["SharedMemory", "connect"]

logger = logging.getLogger(__name__)

_CAPACITY = 4 << 20
"""Bytes of one ring (a larger message streams through it)."""
_RINGS_AT = 4096
"""Offset of the first ring's bytes in a file: the doorbell, the closed flag, the token and
the rings' counters come before."""
_BELL, _CLOSED, _TOKEN, _COUNTERS = 0, 8, 16, 64
_SLICE = 0.5
"""Longest sleep on the doorbell between looks at the deadline and the peers' processes."""
_HEAD = struct.Struct("<qq")  # a message: its channel, its bytes
_GROUPS = ("fwd", "bwd")
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def supported() -> bool:
    """Whether this platform can use shared-memory messages (see the module docstring)."""
    return (
        _libc is not None
        and platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir("/dev/shm")
        and switches.shared_memory()
    )


class _Ring:
    """The bytes one process writes for another: ``head`` bytes written so far (the writer's
    counter), ``tail`` bytes read (the reader's), each on a cache line of its own. Bytes move
    with ``memmove`` between the ring and a tensor's memory (by address)."""

    def __init__(self, buf: mmap.mmap, counters: int, data: int, capacity: int) -> None:
        self.head = ctypes.c_int64.from_buffer(buf, counters)
        self.tail = ctypes.c_int64.from_buffer(buf, counters + 64)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(buf, data))
        self.capacity = capacity

    def write(self, src: int, size: int, start: int) -> int:
        """Copy the bytes at address ``src`` (``size`` of them) from ``start`` on, as many as
        there is room for; return how many."""
        head = self.head.value
        n = max(0, min(self.capacity - (head - self.tail.value), size - start))
        for at, begin, end in self._spans(head, n):
            ctypes.memmove(at, src + start + begin, end - begin)
        self.head.value = head + n  # after the bytes: x86-64 keeps stores in order
        return n

    def read(self, dst: int, size: int, start: int) -> int:
        """Copy the bytes written and not yet read to address ``dst`` (``size`` bytes long)
        from ``start`` on, as many as it takes; return how many."""
        tail = self.tail.value
        n = max(0, min(self.head.value - tail, size - start))
        for at, begin, end in self._spans(tail, n):
            ctypes.memmove(dst + start + begin, at, end - begin)
        self.tail.value = tail + n
        return n

    def _spans(self, at: int, n: int) -> list[tuple[int, int, int]]:
        """The ring's address of byte ``at`` of the stream, ``n`` bytes, in one or two pieces
        (the ring wraps), each with its range in the message."""
        begin = at % self.capacity
        first = min(n, self.capacity - begin)
        spans = [(self.base + begin, 0, first)] if first > 0 else []
        return spans + ([(self.base, first, n)] if n > first else [])


@dataclass
class _Work:
    """A send or receive in flight; :meth:`wait` moves messages until it is done (the
    interface of a ``torch.distributed`` work that the pipe's waits use)."""

    owner: SharedMemory
    peer: int
    buffer: Tensor
    done: bool = False

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def size(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.owner.wait_for(self, None if timeout is None else timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.owner.poll()
        return self.done


@dataclass
class _Outgoing:
    """Bytes waiting for room in a peer's ring: where they are, how many, how many went, what
    keeps them alive, and the send they end (``None`` for a header)."""

    address: int
    size: int
    keep: object
    work: _Work | None
    sent: int = 0


@dataclass
class _Reading:
    """The message a ring is in the middle of: its header so far, or its channel, its
    destination and the bytes read."""

    header: ctypes.Array[ctypes.c_char] = field(
        default_factory=lambda: ctypes.create_string_buffer(_HEAD.size)
    )
    got: int = 0
    channel: int | None = None
    into: Tensor | None = None
    work: _Work | None = None


@dataclass
class _Peer:
    """A neighbouring rank this rank talks to through shared memory."""

    rank: int
    pid: int | None  # checked for life only in the same process namespace
    file: mmap.mmap
    inbox: _Ring  # its messages to this rank (in this rank's file)
    outbox: _Ring  # this rank's messages to it (in its file)
    bell: ctypes.c_int32  # its doorbell
    closed: ctypes.c_int64  # its closed flag
    pending: deque[_Outgoing] = field(default_factory=deque)
    reading: _Reading = field(default_factory=_Reading)


class SharedMemory:
    """This rank's shared-memory messages with its same-host neighbours (see the module
    docstring). Made by :func:`connect`."""

    def __init__(self, rank: int, file: mmap.mmap, peers: dict[int, _Peer]) -> None:
        self.rank = rank
        self._file = file
        self._bell = ctypes.c_int32.from_buffer(file, _BELL)
        self._closed = ctypes.c_int64.from_buffer(file, _CLOSED)
        self._peers = peers
        self._posted: dict[int, deque[_Work]] = {}
        self._stash: dict[int, deque[Tensor]] = {}
        self._lock = threading.Lock()
        self._error: str | None = None

    def covers(self, peer: int | None, t: Tensor, group: str) -> bool:
        """Whether a message with ``peer`` of ``t`` on ``group`` goes through shared memory."""
        return peer in self._peers and t.device.type == "cpu" and group in _GROUPS

    def isend(self, t: Tensor, peer: int, group: str, tag: int) -> _Work:
        """Send ``t`` to ``peer`` on channel (``group``, ``tag``)."""
        work = _Work(self, peer, t.contiguous())
        head = ctypes.create_string_buffer(_HEAD.pack(_channel(self.rank, group, tag), work.size))
        with self._lock:
            self._check()
            p = self._peers[peer]
            p.pending.append(_Outgoing(ctypes.addressof(head), _HEAD.size, head, None))
            p.pending.append(_Outgoing(work.address, work.size, work.buffer, work))
            self._pump()
        return work

    def irecv(self, t: Tensor, peer: int, group: str, tag: int) -> _Work:
        """Receive into ``t`` (a contiguous tensor) the next message of ``peer`` on (``group``,
        ``tag``)."""
        if not t.is_contiguous():
            raise ValueError(f"a receive's buffer must be contiguous, but got strides {t.stride()}")
        work = _Work(self, peer, t)
        channel = _channel(peer, group, tag)
        with self._lock:
            self._check(peers=False)
            stash = self._stash.get(channel)
            if stash:
                self._deliver(work, stash.popleft())
            else:
                self._posted.setdefault(channel, deque()).append(work)
                self._pump()
        return work

    def wait_for(self, work: _Work, seconds: float | None) -> None:
        """Move messages until ``work`` is done; raise ``RuntimeError`` ("timed out") after
        ``seconds``, or if a peer closed or died."""
        if work.done:
            return
        looked = time.monotonic()
        deadline = None if seconds is None else looked + seconds
        peer = self._peers[work.peer]
        while True:
            seen = self._bell.value
            with self._lock:
                self._pump()
                if work.done:
                    return
                self._check()
            left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
            if left <= 0:
                raise RuntimeError(f"timed out after {seconds} s waiting for rank {peer.rank}")
            _futex(ctypes.addressof(self._bell), _FUTEX_WAIT, seen, left)
            if peer.pid is None or time.monotonic() - looked < _SLICE:
                continue
            looked = time.monotonic()
            if not _alive(peer.pid):
                raise RuntimeError(
                    f"Connection closed by peer: rank {peer.rank} (process {peer.pid}) is gone"
                )

    def poll(self) -> None:
        """Move what can move now, without waiting (a failure is raised by the next wait)."""
        with self._lock:
            self._pump()

    def close(self) -> None:
        """Mark this rank's file closed and wake its peers (they fail what waits on it)."""
        self._closed.value = 1
        for p in self._peers.values():
            _ring(p.bell)

    # -- under the lock ----------------------------------------------------------------------
    def _check(self, *, peers: bool = True) -> None:
        """Raise if a message went wrong, this rank closed, or (``peers``) a peer left: what
        it wrote before is still read (a receive only fails once that is done)."""
        if self._error is not None:
            raise RuntimeError(self._error)
        if self._closed.value:
            raise RuntimeError("Connection closed: this rank closed its pipeline's connections")
        for p in self._peers.values() if peers else ():
            if p.closed.value:
                raise RuntimeError(f"Connection closed by peer: rank {p.rank} left the pipeline")

    def _pump(self) -> None:
        """Write what each outbox holds as far as there is room, read every ring, ring the
        peers whose side moved."""
        for p in self._peers.values():
            moved = False
            while p.pending:
                out = p.pending[0]
                n = p.outbox.write(out.address, out.size, out.sent)
                moved |= n > 0
                out.sent += n
                if out.sent < out.size:
                    break
                p.pending.popleft()
                if out.work is not None:
                    out.work.done = True
            moved |= self._read(p)
            if moved:
                _ring(p.bell)

    def _read(self, p: _Peer) -> bool:
        """Read what ``p`` wrote: the header of each message, then its bytes into the
        receive posted for it or into a new stash tensor. True if anything was read."""
        moved = False
        while True:
            r = p.reading
            if r.channel is None:
                n = p.inbox.read(ctypes.addressof(r.header), _HEAD.size, r.got)
                moved |= n > 0
                r.got += n
                if r.got < _HEAD.size:
                    return moved
                channel, size = _HEAD.unpack(r.header.raw)
                r.channel, r.got = channel, 0
                posted = self._posted.get(channel)
                if posted:
                    r.work = posted.popleft()
                    r.into = r.work.buffer
                    self._expect(r.work, size)
                else:
                    r.into = torch.empty(size, dtype=torch.uint8)
            assert r.into is not None
            size = r.into.numel() * r.into.element_size()
            n = p.inbox.read(r.into.data_ptr(), size, r.got)
            moved |= n > 0
            r.got += n
            if r.got < size:
                return moved
            self._arrived(r.channel, r.into, r.work)
            p.reading = _Reading()

    def _arrived(self, channel: int, data: Tensor, work: _Work | None) -> None:
        if work is not None:
            work.done = True
            return
        posted = self._posted.get(channel)
        if posted:
            self._deliver(posted.popleft(), data)
        else:
            self._stash.setdefault(channel, deque()).append(data)

    def _deliver(self, work: _Work, data: Tensor) -> None:
        self._expect(work, data.numel())
        ctypes.memmove(work.address, data.data_ptr(), work.size)
        work.done = True

    def _expect(self, work: _Work, size: int) -> None:
        """Fail (now and from now on) if a message of ``size`` bytes does not fit ``work``'s
        buffer exactly."""
        if work.size != size:
            self._error = (
                f"rank {work.peer} sent {size} bytes where {work.size} were expected (the ranks "
                "disagree on a message's shape)"
            )
            raise RuntimeError(self._error)


class _Card(NamedTuple):
    """What a rank tells its pipeline at set-up: its file (``None``: none), the token written
    in it, its process and process namespace, its neighbours (its rings' order)."""

    path: str | None
    token: str
    pid: int
    namespace: int | None
    neighbours: list[int]


def connect(
    group: dist.ProcessGroup, rank: int, pipeline_ranks: Sequence[int], *, capacity: int = _CAPACITY
) -> SharedMemory | None:
    """Set up shared-memory messages between this rank and each neighbouring position of
    ``pipeline_ranks`` on the same host (every member of ``group`` calls this together);
    ``None`` if there is no such pair or the platform cannot."""
    position = pipeline_ranks.index(rank)
    pp = len(pipeline_ranks)
    neighbours = sorted({pipeline_ranks[(position + d) % pp] for d in (-1, 1)} - {rank})
    mine = _create(len(neighbours), capacity) if supported() and neighbours else None
    token = uuid.uuid4().hex
    if mine is not None:
        mine[1][_TOKEN : _TOKEN + 32] = token.encode()
    card = _Card(mine[0] if mine else None, token, os.getpid(), _namespace(), neighbours)
    cards: dict[int, _Card] = _gathered(group, card)
    opened = {r: _open(cards[r]) for r in neighbours if mine is not None}
    usable = [r for r, f in opened.items() if f is not None]
    agreed: dict[int, list[int]] = _gathered(group, usable)
    if mine is None:
        return None
    os.unlink(mine[0])  # every peer mapped it: nothing is left behind on any exit
    peers = {}
    for r in usable:
        theirs = opened[r]
        if theirs is None or rank not in agreed[r]:
            continue
        peers[r] = _Peer(
            rank=r,
            pid=cards[r].pid if cards[r].namespace == _namespace() else None,
            file=theirs,
            inbox=_ring_at(mine[1], neighbours.index(r), capacity),
            outbox=_ring_at(theirs, cards[r].neighbours.index(rank), capacity),
            bell=ctypes.c_int32.from_buffer(theirs, _BELL),
            closed=ctypes.c_int64.from_buffer(theirs, _CLOSED),
        )
    if not peers:
        return None
    logger.debug("rank %d: shared-memory messages with ranks %s", rank, sorted(peers))
    return SharedMemory(rank, mine[1], peers)


def _gathered(group: dist.ProcessGroup, value: Any) -> dict[int, Any]:
    """``value`` of every rank of ``group``, by global rank."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return dict(zip(dist.get_process_group_ranks(group), every))


def _create(rings: int, capacity: int) -> tuple[str, mmap.mmap] | None:
    """This rank's file (its path and mapping), its bytes reserved; ``None`` if ``/dev/shm``
    cannot hold it."""
    path = f"/dev/shm/pipepar-{uuid.uuid4().hex}"
    size = _RINGS_AT + rings * capacity
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # fails now rather than with SIGBUS when full
        return path, mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        logger.debug("no room in /dev/shm for %d bytes: messages stay on gloo", size)
        return None
    finally:
        os.close(fd)


def _open(card: _Card) -> mmap.mmap | None:
    """The peer's file mapped, if this rank sees the very file (same host); else ``None``."""
    path, token = card.path, card.token
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        file = mmap.mmap(fd, 0)
    except (OSError, ValueError):  # not mappable (an empty file): no shared memory with it
        return None
    finally:
        os.close(fd)
    if file[_TOKEN : _TOKEN + 32] != token.encode():
        file.close()
        return None
    return file


def _ring_at(file: mmap.mmap, slot: int, capacity: int) -> _Ring:
    return _Ring(file, _COUNTERS + 128 * slot, _RINGS_AT + slot * capacity, capacity)


def _channel(sender: int, group: str, tag: int) -> int:
    """A channel's number: the sending rank, the group, the tag."""
    return (sender << 40) | (_GROUPS.index(group) << 32) | tag


def _ring(bell: ctypes.c_int32) -> None:
    bell.value = (bell.value + 1) & 0x7FFFFFFF
    _futex(ctypes.addressof(bell), _FUTEX_WAKE, 0x7FFFFFFF, None)


def _futex(address: int, op: int, value: int, seconds: float | None) -> None:
    assert _libc is not None
    spec = None
    if seconds is not None:
        whole = int(seconds)
        spec = ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9)))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), op, value, spec, None, 0)


def _namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a killed process its parent has not reaped yet is a
    zombie: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
