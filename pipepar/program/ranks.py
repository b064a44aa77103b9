"""Any model across ranks: each rank computes its own stage and only follows the others.

Every rank of a pipeline runs the model's whole ``forward`` for each micro-batch, on its own
driver thread, as in one process (:mod:`pipepar.program.driver`). Its own stage computes for
real; the other stages run *in shadow* on the ``meta`` device: no memory, no arithmetic, only
shapes, dtypes and whether a value needs a gradient, so the rank holds only its own stage's
weights. Token ids, masks and positions keep a small CPU copy of their value
(:class:`~pipepar.program.meta_values.MetaScalars`), so the model's data-dependent checks ("is
the mask all ones?") read what a real run reads and every rank takes the same path through the
code (a fake-tensor mode would not: transformers treats fake tensors as tracing and builds
other masks). :class:`RankCut` then knows, at the same point of the
program on every rank, each value that crosses into or out of the rank's stage:

* a real value of the own stage used by a shadow stage is sent to that stage's rank;
* a shadow value used by the own stage is received from the rank that made it, into a leaf of
  the own stage's graph (its shape and dtype come from the fake value).

Both sides meet the crossings in program order, so sends and receives pair up without any
message describing them. Backward sends each received leaf's gradient back the same way.
Weights tied across stages (GPT-2's embedding and head) are held by every rank whose stage uses
them; their gradients are summed over those ranks after each step, so the copies stay equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.program.cut import Crossing, Cut, Ledger
from pipepar.program.meta_values import SHADOW_LIMIT, MetaScalars
from pipepar.program.step import SegmentContext, SegmentStep
from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh

__all__ = ["Link", "RankCut", "RankStep"]

ACTIVATION, GRADIENT = 1, 2
_KINDS = {ACTIVATION: "an activation", GRADIENT: "a gradient"}


class Link:
    """This rank's point-to-point messages to the ranks of the other stages.

    Activations travel on the mesh's ``fwd`` group, gradients on its ``bwd`` group (closing
    the mesh after a failure wakes a peer blocked on this rank), and every wait goes through
    the mesh's :class:`~pipepar.distributed.progress.Progress`, which gives up after the pipe's
    timeout naming the message and the peer. No frame of this class holds a work while it
    waits (a failure's traceback would keep the groups' connections open).

    Args:
        mesh: this rank's pipeline: the global rank of each stage, the groups, the progress.
        device: where received tensors go.
    """

    def __init__(self, mesh: Mesh, device: torch.device) -> None:
        self.ranks, self.device = list(mesh.pipeline_ranks), device
        self.groups = {ACTIVATION: mesh.fwd, GRADIENT: mesh.bwd}
        self.progress = mesh.progress
        self._sends: list[tuple[dist.Work | None, str]] = []
        self._buffers: list[Tensor] = []  # alive until sent

    def send(self, t: Tensor, stage: int, kind: int) -> None:
        buffer = t.detach().contiguous()
        what = f"sending {self._what(buffer, kind)} to {self._peer(stage)}"
        self._sends.append((self._post(dist.isend, buffer, stage, kind, what), what))
        self._buffers.append(buffer)

    def recv(self, like: Tensor, stage: int, kind: int) -> Tensor:
        out = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        what = f"receiving {self._what(out, kind)} from {self._peer(stage)}"
        self.progress.wait(self._post(dist.irecv, out, stage, kind, what), what)
        return out

    def flush(self) -> None:
        """Wait until every message sent has left."""
        self.progress.wait_all(self._sends)
        self._buffers.clear()

    def drop(self) -> None:
        """Forget every pending send without waiting (after a failure)."""
        self._sends.clear()
        self._buffers.clear()

    def _post(self, op: Any, t: Tensor, stage: int, kind: int, what: str) -> dist.Work | None:
        with comm(what):
            return op(t, self.ranks[stage], group=self.groups[kind], tag=kind)

    def _peer(self, stage: int) -> str:
        return f"rank {self.ranks[stage]} (stage {stage})"

    def _what(self, t: Tensor, kind: int) -> str:
        return f"{_KINDS[kind]} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class RankCut(Cut):
    """The cut of one micro-batch on the rank that computes stage ``own``.

    Args:
        ledger, owner, devices, inputs: as for :class:`~pipepar.program.cut.Cut`.
        own: the stage this rank computes.
        link: messages to the other stages' ranks.
        values: the values of the small integer tensors the shadow stages read.
    """

    def __init__(
        self,
        ledger: Ledger,
        owner: dict[int, int],
        devices: list[torch.device],
        inputs: dict[int, Tensor],
        *,
        own: int,
        link: Link,
        values: MetaScalars,
    ) -> None:
        super().__init__(ledger, owner, devices, inputs)
        self.own, self.link, self.values = own, link, values
        self._metas: dict[int, tuple[Tensor, Tensor]] = {}
        self.exports: list[Crossing] = []

    # The crossings of a rank are the mode's alone (no route, nothing at units' arguments).
    def enter_unit(self, *args: Any) -> None:
        return None

    def leave_unit(self, output: Any) -> None:
        return None

    def finish(self, output: Any) -> None:
        return None

    def _cross(self, t: Tensor) -> Tensor:
        if self.stage != self.own:
            return self._shadow(t)
        if t.is_meta:
            return self._receive(t)
        return t

    def _shadow(self, t: Tensor) -> Tensor:
        """What a shadow stage computes with: meta tensors. A real value of the own stage is
        sent to the stage's rank the first time that stage uses it."""
        if t.is_meta:
            return t
        if self.ledger.stage_of(t) == self.own and self.ledger.first_use(t, self.stage):
            self.exports.append(Crossing(self.own, self.stage, t, t))
            self.link.send(t, self.stage, ACTIVATION)
        return self._meta_of(t)

    def _meta_of(self, t: Tensor) -> Tensor:
        found = self._metas.get(id(t))
        if found is None or found[0] is not t:
            meta = t.to("meta")
            if not t.is_floating_point() and t.numel() <= SHADOW_LIMIT:
                self.values.know(meta, t.detach().cpu())
            found = self._metas[id(t)] = (t, meta)
        return found[1]

    def _receive(self, t: Tensor) -> Tensor:
        """The real value of shadow value ``t`` from the rank of the stage that made it."""
        made = self.ledger.stage_of(t)
        if made is None:
            raise RuntimeError(
                f"stage {self.own} uses a value of shape {tuple(t.shape)} that no stage made in "
                "this micro-batch (kept from an earlier call?); pipepar cannot send it"
            )
        return self.ledger.leaf_from(t, made, self.own, lambda: self._recv(t, made))

    def _recv(self, t: Tensor, made: int) -> Tensor:
        leaf = self.link.recv(t, made, ACTIVATION)
        if t.requires_grad and leaf.is_floating_point():
            leaf.requires_grad_()
        return leaf


class RankStep(SegmentStep):
    """The own stage's F, B and W on a rank: F runs the whole forward (the others in shadow),
    B receives the gradients of what the stage sent and sends those of what it received."""

    def __init__(self, *args: Any, cuts: Sequence[RankCut], link: Link, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cuts, self.link = cuts, link

    def forward(self, i: int, x: Any) -> tuple[()]:
        last = len(self.cuts[i].devices) - 1  # the whole forward, the other stages in shadow
        self.batch.drivers[i].advance(last)
        return ()

    def backward(self, i: int, grads: Any) -> tuple[()]:
        ledger, cut = self.batch.ledgers[i], self.cuts[i]
        pairs = [
            (c.original, self.link.recv(c.original, c.consumer, GRADIENT))
            for c in cut.exports
            if c.original.requires_grad
        ]
        pairs += [(t, ledger.grads[id(t)]) for s, t in ledger.outputs if s == self.stage.index]
        entering = ledger.entering(self.stage.index)
        leaves = [c.leaf for c in entering]
        grads_in: Sequence[Tensor | None] = [None] * len(leaves)
        if pairs:
            grads_in = self._backward(i, pairs, leaves)
        elif self.grad:
            self._closing()
        for crossing, g in zip(entering, grads_in):
            sent = g if g is not None else torch.zeros_like(crossing.leaf)
            self.link.send(sent, crossing.producer, GRADIENT)
        return ()


def shadow_context(values: Sequence[MetaScalars], grad: bool) -> SegmentContext:
    """What a driver enters while it follows a stage of another rank (micro-batch ``i`` reads
    the values of ``values[i]``)."""

    def enter(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(values[i])
        return stack

    return enter


def held_here(
    model: nn.Module, units: Sequence[Any], stage_of_unit: Sequence[int], own: int
) -> list[nn.Parameter]:
    """The parameters this rank holds: those its stage's units use (tied ones included) and the
    loose ones its stage owns."""
    seen: dict[int, nn.Parameter] = {}
    for unit, s in zip(units, stage_of_unit):
        if s == own:
            for p in unit.module.parameters():
                seen.setdefault(id(p), p)
    return list(seen.values())
