"""Messages between the ranks of a pipeline: the activations and gradients that cross stages.

:class:`RankMessages` sends each value one stage of a rank makes for a stage of another rank,
and its gradient back, on a channel of its own per pair of stages; the values one unit call
takes from another rank travel in one message (:meth:`RankMessages.send_many`), and the receive
of a gradient can be posted when its value leaves (:meth:`RankMessages.expect`), before the peer
sends it: on gloo a receive posted after its message came waits a round trip between the ranks'
transport threads. The link counts the seconds spent blocked in its waits
(:attr:`RankMessages.waited`): an action whose forward code receives a value times its own
computation as its duration less what the link waited meanwhile.
A message's tensors are real: the Python modes of the code that sends or receives it (a shadow
stage's meta modes) do not see its operations (:func:`_outside_modes`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh

__all__ = ["ACTIVATION", "GRADIENT", "RankMessages"]

ACTIVATION, GRADIENT = 1, 2
_KINDS = {ACTIVATION: "an activation", GRADIENT: "a gradient"}
_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_modes(method: _F) -> _F:
    """``method`` run outside every torch function and dispatch mode of its caller: a rank
    following another's stage sends from under its meta modes, which would otherwise follow
    each copy, concatenation and send of the message (a third of the walk through GPT-2's
    middle stages)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]


class RankMessages:
    """This rank's point-to-point messages to the ranks of the other stages.

    Activations travel on the mesh's ``fwd`` group, gradients on its ``bwd`` group (closing
    the mesh after a failure wakes a peer blocked on this rank), each pair of stages
    (producer, consumer) on a tag of its own, and every wait goes through
    the mesh's :class:`~pipepar.distributed.progress.Progress`, which gives up after the pipe's
    timeout naming the message and the peer. No frame of this class holds a work while it
    waits (a failure's traceback would keep the groups' connections open).

    Args:
        mesh: this rank's pipeline: the global rank of each position, the groups, the progress.
        device: where received tensors go.
        placement: the schedule's position of each stage.
    """

    def __init__(self, mesh: Mesh, device: torch.device, placement: Sequence[int]) -> None:
        self.ranks, self.device = [mesh.pipeline_ranks[w] for w in placement], device
        self.mesh = mesh
        self.groups = {ACTIVATION: mesh.fwd, GRADIENT: mesh.bwd}
        self.progress = mesh.progress
        self._sends: list[tuple[dist.Work | None, str]] = []
        self._buffers: list[Tensor] = []  # alive until sent
        self._expected: dict[tuple[int, int, int], tuple[Tensor, str, list[dist.Work | None]]] = {}
        self.waited = 0.0
        """Seconds spent so far blocked in this link's waits (a message still on its way):
        an action's own time is its duration less the growth of this count meanwhile. One
        thread waits at a time: a rank's drivers take turns with its walk."""
        self.early = False
        """Whether :meth:`expect` posts a receive at once (only where each stage's backwards
        run in the order of its forwards: the messages of a channel meet the receives posted
        on it in the order they were posted)."""

    @_outside_modes
    def send(self, t: Tensor, kind: int, producer: int, consumer: int) -> None:
        """Send ``t``: an activation of ``producer`` to ``consumer``'s rank, or the gradient
        of one back to ``producer``'s."""
        buffer = t.detach().contiguous()
        self._send(buffer, self._what(buffer, kind), kind, producer, consumer)

    @_outside_modes
    def send_many(self, ts: Sequence[Tensor], kind: int, producer: int, consumer: int) -> None:
        """Send ``ts`` as :meth:`send` does, in one message (their bytes one after another)."""
        if len(ts) == 1:
            return self.send(ts[0], kind, producer, consumer)
        buffer = torch.cat([_bytes(t.detach()) for t in ts])
        return self._send(buffer, self._whats(ts, kind), kind, producer, consumer)

    @_outside_modes
    def recv(self, like: Tensor, kind: int, producer: int, consumer: int) -> Tensor:
        """Receive a tensor shaped as ``like``: an activation of ``producer`` for
        ``consumer``, or the gradient of one from ``consumer``'s rank (the receive
        :meth:`expect` posted for it, if any)."""
        key = (id(like), producer, consumer)
        if kind == GRADIENT and key in self._expected:
            out, what, work = self._expected.pop(key)
            self._wait(work.pop(), what)
            return out
        out = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        self._recv(out, self._what(out, kind), kind, producer, consumer)
        return out

    @_outside_modes
    def recv_many(
        self, likes: Sequence[Tensor], kind: int, producer: int, consumer: int
    ) -> list[Tensor]:
        """Receive what :meth:`send_many` sent: tensors shaped as ``likes``."""
        if len(likes) == 1:
            return [self.recv(likes[0], kind, producer, consumer)]
        outs = [torch.empty(like.shape, dtype=like.dtype, device=self.device) for like in likes]
        sizes = [out.numel() * out.element_size() for out in outs]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        self._recv(buffer, self._whats(outs, kind), kind, producer, consumer)
        for out, part in zip(outs, buffer.split(sizes)):
            _bytes(out).copy_(part)
        return outs

    @_outside_modes
    def expect(self, like: Tensor, producer: int, consumer: int) -> None:
        """Post now the receive of the gradient of ``like``, a value ``producer`` sent to
        ``consumer``, which :meth:`recv` takes later: the peer's send then finds it waiting
        (a receive posted after the message came costs a round trip between the ranks)."""
        if self.early:
            out = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            work, what = self._posted_recv(
                out, self._what(out, GRADIENT), GRADIENT, producer, consumer
            )
            self._expected[(id(like), producer, consumer)] = (out, what, [work])

    def arrived(self, like: Tensor, producer: int, consumer: int) -> bool:
        """Whether the gradient of ``like`` (a value ``producer`` sent to ``consumer``) is
        here: the receive :meth:`expect` posted for it is complete. True where none was
        posted (only :meth:`recv` can tell; it does not wait any less for being asked)."""
        found = self._expected.get((id(like), producer, consumer))
        if found is None or not found[2] or found[2][0] is None:
            return True
        return bool(found[2][0].is_completed())

    def flush(self) -> None:
        """Wait until every message sent has left (every receive posted early was taken)."""
        self.progress.wait_all(self._sends)
        self._buffers.clear()
        if self._expected:
            left = ", ".join(what for _, what, _ in self._expected.values())
            self._expected.clear()
            raise RuntimeError(f"pipepar: receives posted but never taken: {left}")

    def drop(self) -> None:
        """Forget every pending send and receive without waiting (after a failure)."""
        self._sends.clear()
        self._buffers.clear()
        self._expected.clear()

    def _send(self, buffer: Tensor, value: str, kind: int, producer: int, consumer: int) -> None:
        peer = _sender_peer(kind, producer, consumer)
        what = f"sending {value} to {self._peer(peer)}"
        work = self._post(self.mesh.isend, buffer, what, kind, peer, self._tag(producer, consumer))
        self._sends.append((work, what))
        self._buffers.append(buffer)
        self._forget_sent()

    def _forget_sent(self) -> None:
        """Let go of the sends that have left, and of their buffers: a buffer kept to the
        step's end holds a value the stage has long let go of (a 1F1B stage would hold every
        micro-batch's output). Every one that has left, not only up to the first still on its
        way: a gloo send reports itself done only once waited for, so a small value sent to a
        rank further down the pipe (GPT-2's position ids) would keep every later message's
        buffer to the step's end. Waiting on a finished send returns at once, or raises if it
        failed."""
        sends, buffers = [], []
        for (work, what), buffer in zip(self._sends, self._buffers, strict=True):
            if work is None or work.is_completed():
                self._wait(work, what)
            else:
                sends.append((work, what))
                buffers.append(buffer)
        self._sends[:], self._buffers[:] = sends, buffers

    def _recv(self, buffer: Tensor, value: str, kind: int, producer: int, consumer: int) -> None:
        self._wait(*self._posted_recv(buffer, value, kind, producer, consumer))

    def _wait(self, work: dist.Work | None, what: str) -> None:
        """Wait for ``work`` (bounded, reported), counting the time in :attr:`waited`."""
        start = time.perf_counter()
        try:
            self.progress.wait(work, what)
        finally:
            self.waited += time.perf_counter() - start

    def _posted_recv(
        self, buffer: Tensor, value: str, kind: int, producer: int, consumer: int
    ) -> tuple[dist.Work | None, str]:
        """Post the receive into ``buffer``: its work and what it is."""
        peer = _receiver_peer(kind, producer, consumer)
        what = f"receiving {value} from {self._peer(peer)}"
        tag = self._tag(producer, consumer)
        return self._post(self.mesh.irecv, buffer, what, kind, peer, tag), what

    def _tag(self, producer: int, consumer: int) -> int:
        """The channel of values from ``producer`` to ``consumer`` (and of their gradients)."""
        return producer * len(self.ranks) + consumer

    def _post(
        self, op: Any, t: Tensor, what: str, kind: int, peer: int, tag: int
    ) -> dist.Work | None:
        """``op`` (isend or irecv) of ``t`` with the rank of stage ``peer`` on channel ``tag``."""
        with comm(what):
            return op(t, self.ranks[peer], self.groups[kind], tag)

    def _peer(self, stage: int) -> str:
        return f"rank {self.ranks[stage]} (stage {stage})"

    def _what(self, t: Tensor, kind: int) -> str:
        return f"{_KINDS[kind]} {_described(t)}"

    def _whats(self, ts: Sequence[Tensor], kind: int) -> str:
        shapes = ", ".join(_described(t) for t in ts)
        return f"{len(ts)} values in one message ({_KINDS[kind]} each: {shapes})"


def _described(t: Tensor) -> str:
    """``t``'s shape and dtype, e.g. ``(2, 64) int64``."""
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _sender_peer(kind: int, producer: int, consumer: int) -> int:
    """The stage a message goes to: an activation to its consumer, a gradient back to the
    producer."""
    return consumer if kind == ACTIVATION else producer


def _receiver_peer(kind: int, producer: int, consumer: int) -> int:
    """The stage a message comes from: an activation from its producer, a gradient from the
    consumer."""
    return producer if kind == ACTIVATION else consumer


def _bytes(t: Tensor) -> Tensor:
    """The elements of ``t`` as bytes: a view of ``t`` when it is contiguous."""
    flat = t.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
