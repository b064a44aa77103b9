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
message describing them. The crossings at units' arguments are made by the units' hooks, at the
same point of the program on every rank; once a kind of call has a learned route
(:mod:`pipepar.program.route`), a rank runs its own stage without the mode, skips the units of
the other stages (:func:`skip_elsewhere`: their outputs stand in on ``meta``, shaped as the
route learned) and runs the few operations between those units under :class:`ToMeta`.
Backward sends each received leaf's gradient back the same way.
Weights tied across stages (GPT-2's embedding and head) are held by every rank whose stage uses
them; their gradients are summed over those ranks after each step, so the copies stay equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipepar.program.cut import Crossing, Cut, Ledger, map_arguments, tag_stage
from pipepar.program.driver import active
from pipepar.program.meta_values import SHADOW_LIMIT, MetaScalars
from pipepar.program.route import Routes, check_graphs
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
        routes: Routes | None = None,
        key: Hashable = None,
    ) -> None:
        super().__init__(ledger, owner, devices, inputs, routes, key)
        self.own, self.link, self.values = own, link, values
        self._metas: dict[int, tuple[Tensor, Tensor]] = {}
        self._stand_ins: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.exports: list[Crossing] = []

    # -- at units' arguments --------------------------------------------------------------------
    def _enter(self, t: Tensor, producer: int, stage: int) -> Tensor:
        """A value of ``producer`` given to a unit of ``stage``: received from its rank into a
        leaf of the own stage, or (another stage's unit) a stand-in on ``meta``, sent first to
        that stage's rank when the own stage made it."""
        if stage == self.own:
            return self.ledger.leaf_from(t, producer, stage, lambda: self._recv(t, producer))
        found = self._stand_ins.get((id(t), stage))
        if found is None or found[0] is not t:
            if producer == self.own and self.ledger.first_use(t, stage):
                self.exports.append(Crossing(self.own, stage, t, t))
                self.link.send(t, stage, ACTIVATION)
            stand_in = (t if t.is_meta else self._meta_of(t)).detach()
            if t.requires_grad and stand_in.is_floating_point():
                stand_in.requires_grad_()
            tag_stage(stand_in, self.ledger, stage)
            found = self._stand_ins[(id(t), stage)] = (t, stand_in)
        return found[1]

    def _placed(self, t: Tensor, stage: int) -> Tensor:
        return t if stage != self.own or t.is_meta else super()._placed(t, stage)

    def leave_unit(self, output: Any) -> None:
        if self.route is None and self._open and self.stage != self.own:
            self.record.templates[self._open[-1]] = template(output)
        super().leave_unit(output)

    def stub(self) -> Callable[[], Any] | None:
        """What stands in for the output of the unit call just entered, when it is another
        stage's and the route knows its shape: it is not run here."""
        if self.route is None or self.stage == self.own or not self._open:
            return None
        shape = self.route.templates.get(self._open[-1])
        return None if shape is None else lambda: from_template(shape)

    def shadowing(self) -> contextlib.AbstractContextManager[Any]:
        """What another stage's code runs under when following a route: its tensors on
        ``meta`` (the cut's mode does it otherwise)."""
        return ToMeta(self) if self.following else contextlib.nullcontext()

    def _check_graph(self, outputs: list[tuple[Tensor, int]]) -> None:
        """The own stage's graph is its own: from what it returns and sends back to its
        parameters and the leaves it received."""
        roots = [(t, s) for t, s in outputs if s == self.own and not t.is_meta]
        roots += [(c.original, self.own) for c in self.exports if not c.original.is_meta]
        leaves = {id(c.leaf): self.own for c in self.ledger.crossings if c.consumer == self.own}
        check_graphs(roots, leaves, self.owner, self.key)

    def _changed(self, why: str) -> None:
        super()._changed(
            f"{why}; across ranks a step cannot be run again, so pass routes=False to "
            "pipepar.distributed.wrap for a model whose units run in an order that depends on "
            "the data"
        )

    # -- under the mode (learning a route, or a model whose values cross elsewhere) -------------
    def _crossed(self, t: Tensor) -> Tensor:
        return self._cross(t)  # what is a crossing is decided below, not by identity

    def _cross(self, t: Tensor) -> Tensor:
        made = self.ledger.stage_of(t)
        if self.stage != self.own:
            own_value = made == self.own and not t.is_meta
            if own_value or (t.is_meta and made not in (None, self.stage)):
                self.loose = True  # a crossing in the model's own code: no route
            return self._shadow(t)
        if t.is_meta:
            self.loose = True
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


class ToMeta(TorchFunctionMode):
    """Another stage's code on a rank that follows a route: every real tensor an operation
    is given becomes its ``meta`` twin (small integer values kept for the model's reads)."""

    def __init__(self, cut: RankCut) -> None:
        super().__init__()
        self.cut = cut

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        args = tuple(map_arguments(a, self._meta) for a in args)
        kwargs = {k: map_arguments(v, self._meta) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    def _meta(self, t: Tensor) -> Tensor:
        return t if t.is_meta else self.cut._meta_of(t)


def template(output: Any) -> tuple[Any, list[Any]]:
    """The shape of a unit's output: its structure, and each tensor's shape and dtype."""
    leaves, spec = pytree.tree_flatten(output)
    described = [
        (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, Tensor) else t for t in leaves
    ]
    return spec, described


def from_template(shape: tuple[Any, list[Any]]) -> Any:
    """An output of that shape on ``meta``."""
    spec, described = shape
    leaves = [
        torch.empty(d[0], dtype=d[1], device="meta", requires_grad=d[2] and d[1].is_floating_point)
        if isinstance(d, tuple) and len(d) == 3 and isinstance(d[1], torch.dtype)
        else d
        for d in described
    ]
    return pytree.tree_unflatten(leaves, spec)


def skip_elsewhere(units: Sequence[Any], stage_of_unit: Sequence[int], own: int) -> None:
    """Let every unit with parameters of another stage than ``own`` be skipped by a rank that
    follows a route (its output stood in on ``meta``; run as usual otherwise)."""
    for unit, s in zip(units, stage_of_unit):
        if s != own and unit.has_parameters:
            unit.module.forward = _skippable(unit.module.forward)


def _skippable(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        driver = active()
        follower = driver.follower if driver is not None else None
        stand_in = follower.stub() if isinstance(follower, RankCut) else None
        return forward(*args, **kwargs) if stand_in is None else stand_in()

    return run


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


def shadow_context(cuts: Sequence[RankCut], grad: bool) -> SegmentContext:
    """What a driver enters while it follows a stage of another rank (micro-batch ``i`` reads
    the values of ``cuts[i].values``)."""

    def enter(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(cuts[i].values)
        stack.enter_context(cuts[i].shadowing())
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
