"""Point-to-point hand-off of activations (stage s to s+1) and gradients (s+1 to s) between ranks.

The peer of a message is the rank that holds the other stage: for stage ``s``, the one at
position ``placement[s + 1]`` (or ``[s - 1]``) of ``pipeline_ranks``. That is the next position,
or any position with virtual stages (looped placement sends from the last rank back to rank 0).
Neighbouring stages on one rank never come here; the runtime hands their values over in memory.
Bytes move by the mesh's isend/irecv (``torch.distributed``'s, or shared memory between CPU
neighbours on one host: :mod:`~pipepar.ranks.shared_memory`). A receive needs a buffer of the
right shape, so when the shapes of a mini-batch are new, each activation is preceded by a small
metadata message (dtype, requires_grad, shape of every tensor); the runtime caches the shapes
and later mini-batches with the same input signature post their receives early, before the data
is sent.

Every stage boundary has its own channels, one per (direction, receiving stage): activations
into stage ``s`` travel on the ``fwd`` group, the gradients of stage ``s``'s output back into
``s`` on the ``bwd`` group, each with the tag of ``s`` (metadata and data on two tags of their
own), so boundaries that share a pair of ranks (virtual stages) never mix. Messages keep their
order within a group, pair of ranks and tag, and both sides walk each stage's micro-batches in
the same order (checked when the schedule is), so receives match sends without per-message
bookkeeping. Every wait goes through the mesh's
:class:`~pipepar.ranks.progress.Progress`: it gives up after the pipe's timeout, naming
the message and the peer (rank and stage) it waited for.
With ``PIPEPAR_DEBUG=1`` every send and receive is logged at DEBUG level.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipepar.core.logs import debug_enabled
from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh

__all__ = ["Incoming", "TensorMeta", "Transport", "decode_meta", "encode_meta"]

logger = logging.getLogger(__name__)

_HEADER = 1  # tag of the mini-batch header; then two channels (metadata, data) per stage:
_META, _DATA = 0, 1


def _tag(kind: int, stage: int) -> int:
    """The tag of ``kind`` (metadata or data) messages into stage ``stage`` (or its grads)."""
    return 8 + 2 * stage + kind


_META_LEN = 64
#: Fewest gradient sends kept in flight before the oldest is awaited.
_MIN_SEND_WINDOW = 2
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a buffer for one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: Tensor) -> TensorMeta:
        """The metadata of ``t``."""
        return cls(tuple(t.shape), t.dtype, t.requires_grad)


def encode_meta(metas: Sequence[TensorMeta], device: torch.device) -> Tensor:
    """Pack tensor metadata into a fixed-size int64 message.

    Example:
        >>> m = TensorMeta((4, 2), torch.float32, True)
        >>> decode_meta(encode_meta([m], torch.device("cpu"))) == (m,)
        True
    """
    words = [len(metas)]
    for m in metas:
        if m.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {m.dtype} tensor between stages; use one of {_DTYPES}")
        words += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(words) > _META_LEN:
        raise ValueError(
            f"a stage output of {len(metas)} tensors needs {len(words)} metadata words but at "
            f"most {_META_LEN} fit; return fewer or lower-dimensional tensors from the stage"
        )
    words += [0] * (_META_LEN - len(words))
    return torch.tensor(words, dtype=torch.int64, device=device)


def decode_meta(message: Tensor) -> tuple[TensorMeta, ...]:
    """Unpack what :func:`encode_meta` packed."""
    words = message.tolist()
    metas, k = [], 1
    for _ in range(words[0]):
        dtype, grad, ndim = _DTYPES[words[k]], bool(words[k + 1]), words[k + 2]
        metas.append(TensorMeta(tuple(words[k + 3 : k + 3 + ndim]), dtype, grad))
        k += 3 + ndim
    return tuple(metas)


@dataclass
class Incoming:
    """Receives posted for one micro-batch: buffers filling in and their pending works."""

    microbatch: int
    buffers: tuple[Tensor, ...]
    works: list[dist.Work | None]
    what: str
    src: int
    stage: int
    """The receiving stage (named in traces and errors)."""


class Transport:
    """Sends and receives of one rank, on the mesh's ``fwd`` and ``bwd`` groups.

    Args:
        mesh: this rank's grid position and groups.
        device: where received buffers are allocated.
        send_window: gradient sends kept in flight before the oldest is awaited; the stage's
            in-flight bound keeps the gradient buffers in step with the activations it holds
            (awaiting sooner would stall on a receiver that is still busy).
    """

    def __init__(self, mesh: Mesh, device: torch.device, *, send_window: int = 2) -> None:
        self.mesh = mesh
        self.device = device
        self.send_window = max(_MIN_SEND_WINDOW, send_window)
        self.debug = debug_enabled()
        self._fwd_sends: dict[tuple[int, int], list[dist.Work | None]] = {}
        self._grad_sends: deque[tuple[list[dist.Work | None], str]] = deque()

    # -- mini-batch header: lets every stage know the input signature ------------------------
    def exchange_header(
        self, signature: int | None, microbatches: int = 0, call: int = 0
    ) -> tuple[int, int, int]:
        """Position 0 (which holds stage 0) passes ``signature``, the mini-batch's number of
        micro-batches and which call it runs (a training step, an evaluation...); every rank
        gets them from the previous position and hands them to the next."""
        m = self.mesh
        header = torch.tensor(
            [-1 if signature is None else signature, microbatches, call], device=self.device
        )
        if m.prev_rank is not None:
            work = self._irecv(header, m.prev_rank, m.fwd, _HEADER, "the header")
            self._wait(work, f"receiving the header from rank {m.prev_rank}")
            self._trace("recv header", int(header[0].item()), m.prev_rank, ())
        if m.next_rank is not None:
            self._fwd_sends.setdefault((-1, -1), []).append(
                self._isend(header, m.next_rank, m.fwd, _HEADER, "the header")
            )
            self._trace("send header", int(header[0].item()), m.next_rank, ())
        signature, microbatches, call = (int(v) for v in header.tolist())
        return signature, microbatches, call

    # -- activations, stage s-1 -> s (stage: the receiving one) ------------------------------
    def send_activation(
        self,
        i: int,
        tensors: Sequence[Tensor],
        *,
        dst: int,
        stage: int,
        metas: Sequence[TensorMeta] | None,
    ) -> None:
        """Send micro-batch ``i``'s input of stage ``stage`` to rank ``dst``, after its
        ``metas`` (shapes, dtypes, which get a gradient back) on a new signature."""
        group, what = self.mesh.fwd, f"activation {i}{_for(stage)}"
        works = []
        if metas is not None:
            meta = encode_meta(metas, self.device)
            works.append(self._isend(meta, dst, group, _tag(_META, stage), f"metadata of {what}"))
        works += [
            self._isend(t.detach().contiguous(), dst, group, _tag(_DATA, stage), what)
            for t in tensors
        ]
        self._fwd_sends[(stage, i)] = works
        self._trace("send activation", i, dst, tensors, stage)

    def recv_meta(self, *, src: int, stage: int) -> tuple[TensorMeta, ...]:
        """Receive the metadata message that precedes an activation on a new signature."""
        message = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
        what = f"metadata{_for(stage)}"
        work = self._irecv(message, src, self.mesh.fwd, _tag(_META, stage), what)
        self._wait(work, f"receiving {what} from rank {src} (stage {stage - 1})")
        metas = decode_meta(message)
        self._trace("recv metadata", -1, src, (), stage)
        return metas

    def post_activation(
        self, i: int, metas: Sequence[TensorMeta], *, src: int, stage: int
    ) -> Incoming:
        """Post the receives of micro-batch ``i``'s input of stage ``stage`` from rank ``src``."""
        return self._post(i, metas, src, self.mesh.fwd, stage, "activation")

    # -- gradients, stage s+1 -> s (stage: the receiving one) --------------------------------
    def send_grad(self, i: int, grads: Sequence[Tensor], *, dst: int, stage: int) -> None:
        """Send the gradients of stage ``stage``'s output of micro-batch ``i`` to rank ``dst``."""
        what = f"gradient {i}{_for(stage)}"
        works = [
            self._isend(g.contiguous(), dst, self.mesh.bwd, _tag(_DATA, stage), what) for g in grads
        ]
        self._grad_sends.append((works, f"sending {what} to rank {dst}"))
        self._trace("send gradient", i, dst, grads, stage)
        while len(self._grad_sends) > self.send_window:  # long received, normally
            self._wait_all(*self._grad_sends.popleft())

    def post_grad(self, i: int, metas: Sequence[TensorMeta], *, src: int, stage: int) -> Incoming:
        """Post the receives of the gradients of stage ``stage``'s output of micro-batch ``i``."""
        return self._post(i, metas, src, self.mesh.bwd, stage, "gradient")

    def release_activation(self, stage: int, i: int) -> None:
        """Forget the finished send of micro-batch ``i`` into ``stage`` (its gradient came
        back, so it arrived)."""
        works = self._fwd_sends.pop((stage, i), None)
        if works:
            self._wait_all(works, f"sending activation {i}{_for(stage)}")

    # -- completion ---------------------------------------------------------------------------
    def take(self, incoming: Incoming) -> tuple[Tensor, ...]:
        """Wait for a posted receive and return its buffers."""
        src, i, stage = incoming.src, incoming.microbatch, incoming.stage
        made_by = stage - 1 if incoming.what == "activation" else stage + 1
        what = f"receiving {incoming.what} {i}{_for(stage)} from rank {src} (stage {made_by})"
        self._wait_all(incoming.works, what)
        self._trace(f"recv {incoming.what}", i, src, incoming.buffers, stage)
        return incoming.buffers

    def flush(self) -> None:
        """Wait for every send still in flight (end of a mini-batch)."""
        for stage, i in list(self._fwd_sends):
            self.release_activation(stage, i)
        while self._grad_sends:
            self._wait_all(*self._grad_sends.popleft())

    def drop(self) -> None:
        """Forget every pending work without waiting (after a failure)."""
        self._fwd_sends.clear()
        self._grad_sends.clear()

    # -- helpers ------------------------------------------------------------------------------
    def _post(
        self,
        i: int,
        metas: Sequence[TensorMeta],
        src: int,
        group: dist.ProcessGroup | None,
        stage: int,
        what: str,
    ) -> Incoming:
        buffers = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
        tag, shown = _tag(_DATA, stage), f"{what} {i}{_for(stage)}"
        works = [self._irecv(b, src, group, tag, shown) for b in buffers]
        return Incoming(i, buffers, works, what, src, stage)

    def _isend(
        self, t: Tensor, dst: int | None, group: dist.ProcessGroup | None, tag: int, what: str
    ) -> dist.Work | None:
        with comm(f"sending {what} to rank {dst}"):
            return self.mesh.isend(t, dst, group, tag)  # type: ignore[arg-type]

    def _irecv(
        self, t: Tensor, src: int | None, group: dist.ProcessGroup | None, tag: int, what: str
    ) -> dist.Work | None:
        with comm(f"receiving {what} from rank {src}"):
            return self.mesh.irecv(t, src, group, tag)  # type: ignore[arg-type]

    def _wait(self, work: dist.Work | None, what: str) -> None:
        self.mesh.progress.wait(work, what)

    def _wait_all(self, works: Sequence[dist.Work | None], what: str) -> None:
        for work in works:
            self._wait(work, what)

    def _trace(
        self,
        verb: str,
        i: int,
        peer: int | None,
        tensors: Sequence[Tensor],
        stage: int | None = None,
    ) -> None:
        if self.debug:
            shapes = [tuple(t.shape) for t in tensors]
            where = "" if stage is None else _for(stage)
            logger.debug(
                "%s: %s %d%s with rank %s %s", self.mesh.where, verb, i, where, peer, shapes
            )


def _for(stage: int) -> str:
    """How messages name the stage whose channel they use (the receiving stage)."""
    return f" for stage {stage}"
