"""Any model across ranks: each rank computes its own stages and only follows the others.

Every rank of a pipeline runs the model's whole ``forward`` for each micro-batch, on its own
driver thread, as in one process (:mod:`pipepar.program.driver`). Its own stages (one, or
several under the virtual-stage schedules) compute for real; the other stages run *in shadow*
on the ``meta`` device: no memory, no arithmetic, only shapes, dtypes and whether a value needs
a gradient, so the rank holds only its own stages' weights. Token ids, masks and positions keep
a small CPU copy of their value (:class:`~pipepar.meta.values.MetaScalars`), so the
model's data-dependent checks ("is the mask all ones?") read what a real run reads and every
rank takes the same path through the code (a fake-tensor mode would not: transformers treats
fake tensors as tracing and builds other masks). :class:`RankCut` then knows, at the same point
of the program on every rank, each value that crosses into or out of the rank's stages:

* a real value of an own stage used by a shadow stage is sent to that stage's rank;
* a shadow value used by an own stage is received from the rank that made it, into a leaf of
  the own stage's graph (its shape and dtype come from the fake value);
* a value of an own stage used by another own stage (zb-v's middle stages) is handed over as
  in one process: a leaf of the later stage, whose gradient goes back through the ledger.

Both sides meet the crossings in program order, so sends and receives pair up without any
message describing them; each (producer, consumer) pair of stages has a channel of its own, as a
rank's actions of two stages may interleave differently on the two sides. The crossings at
units' arguments are made by the units' hooks, at the same point of the program on every rank;
once a kind of call has a learned route (:mod:`pipepar.program.route`), a rank runs its own
stages without the mode, skips the units of the other stages and runs the few operations between
them on ``meta`` (:mod:`pipepar.program.shadow`). The values one unit call takes from another
rank's stage travel in one message (:mod:`pipepar.program.rank_messages`). Backward sends each
received leaf's gradient back the same way. Weights tied across stages (GPT-2's embedding and
head) are held by every rank whose stages use them (:mod:`pipepar.program.rank_weights`); within
a rank the later stages use an alias whose gradient is added to the holder's, as in one process,
and the sums are added over the ranks after each step, so the copies stay equal.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.meta.values import SHADOW_LIMIT, MetaScalars
from pipepar.program.aliases import Aliases
from pipepar.program.cut import Crossing, Cut, Ledger, tag_stage
from pipepar.program.rank_messages import ACTIVATION, GRADIENT, RankMessages
from pipepar.program.route import Routes, check_graphs
from pipepar.program.shadow import ToMeta, from_template, on_meta, template
from pipepar.program.step import SegmentContext, SegmentStep

__all__ = ["RankCut", "RankStep", "WeightStages", "shadow_context"]


_TOLIST = Tensor.tolist
_FROM_DATA = (torch.tensor, torch.as_tensor)


class RankCut(Cut):
    """The cut of one micro-batch on the rank that computes the stages ``mine``.

    Args:
        ledger, owner, devices, inputs: as for :class:`~pipepar.program.cut.Cut` (``owner``:
            the own stage holding each of the rank's weights).
        mine: the stages this rank computes.
        link: messages to the other stages' ranks.
        values: the values of the small integer tensors the shadow stages read.
        routes, key, aliases, model: as for :class:`~pipepar.program.cut.Cut`.
    """

    def __init__(
        self,
        ledger: Ledger,
        owner: dict[int, int],
        devices: list[torch.device],
        inputs: dict[int, Tensor],
        *,
        mine: Collection[int],
        link: RankMessages,
        values: MetaScalars,
        routes: Routes | None = None,
        key: Hashable = None,
        aliases: Aliases | None = None,
        model: nn.Module | None = None,
        weights: WeightStages | None = None,
    ) -> None:
        super().__init__(ledger, owner, devices, inputs, routes, key, aliases, model)
        self.mine, self.link, self.values = frozenset(mine), link, values
        self.weights = weights if weights is not None else WeightStages({}, {})
        self._lent: dict[int, Tensor] = {}
        """This micro-batch's view of each own weight sent to a stage that does not hold it:
        a value of its own, as an activation is, whose gradient reaches the weight."""
        self._metas: dict[int, tuple[Tensor, Tensor]] = {}
        self._stand_ins: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.exports: list[Crossing] = []
        """The own stages' values sent to other ranks (their gradients come back)."""
        self._sent: set[tuple[int, int]] = set()
        """``(id(value), rank)`` for each value sent to a rank (held by :attr:`exports`)."""

    # -- at units' arguments --------------------------------------------------------------------
    def _enter(self, t: Tensor, producer: int, stage: int) -> Tensor:
        """A value of ``producer`` given to a unit of ``stage``: for an own stage, a leaf
        (received from the producer's rank, or handed over by an own producer), else a
        stand-in on ``meta`` (an own stage's value was sent to that stage's rank by
        :meth:`_enter_all`)."""
        if stage in self.mine and producer in self.mine:
            return super()._enter(t, producer, stage)
        if stage in self.mine:
            return self.ledger.leaf_from(t, producer, stage, lambda: self._recv(t, producer))
        found = self._stand_ins.get((id(t), stage))
        if found is None or found[0] is not t:
            stand_in = (t if t.is_meta else self._meta_of(t)).detach()
            if t.requires_grad and stand_in.is_floating_point():
                stand_in.requires_grad_()
            tag_stage(stand_in, self.ledger, stage, self.ledger.of_rows(t))
            found = self._stand_ins[(id(t), stage)] = (t, stand_in)
        return found[1]

    def _enter_all(
        self, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> dict[int, Tensor]:
        """As in one process; the values that cross between this rank and another at one unit
        call travel in one message per pair of stages (each message costs a wait, and a
        thread that waits must win the interpreter lock back)."""
        if stage in self.mine:
            self._receive_all(flat, crossings, stage)
        else:
            self._export_all(flat, crossings, stage)
        return super()._enter_all(flat, crossings, stage)

    def _skipped(
        self, weighted: bool, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> bool:
        """A unit with weights of another rank's stage, followed on a route that knows its
        output, is stood in by :meth:`stub`: its own stages' values are sent, and no stand-ins
        are made for arguments nothing computes with."""
        stood_in = (
            weighted
            and stage not in self.mine
            and self.route is not None
            and self.route.templates.get(self._open[-1]) is not None
        )
        if stood_in:
            self._export_all(flat, crossings, stage)
        return stood_in

    def _receive_all(
        self, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> None:
        """Receive what other ranks send for this unit call of own ``stage``: the leaves of the
        values it has not used before."""
        wanted: dict[int, list[Tensor]] = {}
        seen: set[int] = set()
        for j, p in crossings:
            t = flat[j]
            if p not in self.mine and id(t) not in seen and not self.ledger.has(t, stage):
                seen.add(id(t))
                kept = self._received(t, stage)
                if kept is not None:
                    self.ledger.leaf_from(t, p, stage, functools.partial(_leaf, kept, t))
                else:
                    wanted.setdefault(p, []).append(t)
        for p, ts in wanted.items():
            for t, value in zip(ts, self.link.recv_many(ts, ACTIVATION, p, stage)):
                self.ledger.leaf_from(t, p, stage, functools.partial(_leaf, value, t))

    def _export_all(
        self, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> None:
        """Send the own stages' values that this unit call of another rank's ``stage`` uses
        for the first time."""
        going: dict[int, list[Tensor]] = {}
        for j, p in crossings:
            if p in self.mine:
                going.setdefault(p, []).append(flat[j])
        for p, ts in going.items():
            self._send_first(ts, p, stage)

    def release(self, stage: int) -> None:
        """Let go of own stage ``stage``'s values sent to other ranks once its backward is
        done (their gradients came back in its B): they hold its graph."""
        self.exports = [c for c in self.exports if c.producer != stage]
        made = self.ledger.stage_of
        self._metas = {k: v for k, v in self._metas.items() if made(v[0]) != stage}
        self._stand_ins = {k: v for k, v in self._stand_ins.items() if made(v[0]) != stage}

    def _export(self, t: Tensor, producer: int | None, stage: int) -> None:
        """Send ``t`` to the rank of ``stage`` (not this one's) on that stage's first use of
        it, if an own stage made it."""
        if producer in self.mine:
            self._send_first([t], producer, stage)

    def _send_first(self, ts: Sequence[Tensor], producer: int, stage: int) -> None:
        """Send, in one message, those of own stage ``producer``'s values ``ts`` that
        ``stage`` uses for the first time, and post the receives of their gradients (what
        :class:`RankStep` takes in the producer's backward) for those that will have one."""
        first = [t for t in ts if self.ledger.first_use(t, stage)]
        if not first:
            return
        self.exports += [Crossing(producer, stage, t, t) for t in first]
        going = [t for t in first if self._first_to_rank(t, stage)]
        if going:
            self.link.send_many(going, ACTIVATION, producer, stage)
        for t in first:
            if t.requires_grad and torch.is_grad_enabled():
                self.link.expect(t, producer, stage)

    def _first_to_rank(self, t: Tensor, stage: int) -> bool:
        """Whether ``t`` goes to ``stage``'s rank for the first time (noting it): a rank
        computing several stages is sent a value once, and its later stages copy what it
        received (:meth:`_received`, the same decision on the receiving side)."""
        key = (id(t), self.link.ranks[stage])
        if key in self._sent:
            return False
        self._sent.add(key)
        return True

    def _received(self, t: Tensor, stage: int) -> Tensor | None:
        """A copy of the value of another rank's ``t`` that an own stage other than
        ``stage`` received before, or None (it is received now)."""
        for other in self.mine:
            leaf = self.ledger.leaf_of(t, other) if other != stage else None
            if leaf is not None:
                return leaf.detach().clone()  # a stage may write into its own copy
        return None

    def _placed(self, t: Tensor, stage: int) -> Tensor:
        return t if stage not in self.mine or t.is_meta else super()._placed(t, stage)

    def leave_unit(self, output: Any) -> None:
        if self.route is None and self._open and self.stage not in self.mine:
            self.record.templates[self._open[-1]] = template(output)
        super().leave_unit(output)

    def stub(self) -> Callable[[], Any] | None:
        """What stands in for the output of the unit call just entered, when it is another
        rank's stage and the route knows its shape: it is not run here."""
        if self.route is None or self.stage in self.mine or not self._open:
            return None
        shape = self.route.templates.get(self._open[-1])
        return None if shape is None else lambda: from_template(shape)

    def done(self) -> bool:
        """Whether the driver may stop at the unit call it enters: it follows a route, runs
        another rank's stage with no own stage after it, and has sent every value the route
        sends (the rest runs on other ranks; the own graphs are checked now, as at the
        forward's end)."""
        route = self.route
        if route is None or max(self.mine) >= self.stage:
            return False
        if len(self.exports) < route.sends:
            return False
        if torch.is_grad_enabled():
            self._check_graph([])
        return True

    def finish(self, output: Any) -> None:
        if self.route is None:  # learning: how many values this rank sends
            self.record.sends = len(self.exports)
        super().finish(output)

    def shadowing(self) -> contextlib.AbstractContextManager[Any]:
        """What another rank's stage's code runs under when following a route: its tensors on
        ``meta`` (the cut's mode does it otherwise)."""
        return ToMeta(self._meta_of, self._twin) if self.following else contextlib.nullcontext()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is _TOLIST and self.stage not in self.mine:
            read = self._read(args[0])
            if read is not None:
                return read.tolist()
        if func in _FROM_DATA and self.stage not in self.mine:
            numbers = self._from_numbers(func, args, kwargs or {})
            if numbers is not None:
                return numbers
        out = super().__torch_function__(func, types, args, kwargs)
        if self.stage in self.mine:
            return out
        made = on_meta(out, self._twin)  # a shadow stage holds no real tensor
        if made is not out:
            self._tag(made, self._made_rows)
        return made

    def _from_numbers(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor | None:
        """``torch.tensor(data, device=...)`` in a shadow stage, made on the CPU from the
        known values of the meta scalars in ``data`` and stood in by its twin on meta (which
        knows the value, as :meth:`_twin` does for any constant); None where one is not
        known."""
        try:
            data = pytree.tree_map_only(Tensor, self._known, args)
        except LookupError:
            return None
        with torch._C.DisableTorchFunction():
            out = func(*data, **{**kwargs, "device": "cpu"})
        made = self._twin(out)
        self._tag(made)
        return made

    def _known(self, t: Tensor) -> Tensor:
        if not t.is_meta:
            return t
        value = self.values.value(t)
        if value is None:
            raise LookupError("a value the shadow does not know")
        return value

    def _read(self, t: Any) -> Tensor | None:
        """What a shadow stage reads as numbers (``tensor.tolist()``: a grid of image sizes):
        a call's input or a constant as it is, a meta tensor by its known value."""
        if not isinstance(t, Tensor):
            return None
        if t.is_meta:
            return self.values.value(t)
        return t if self.ledger.stage_of(t) is None else None

    def _check_crossing(self, t: Tensor, producer: int) -> None:
        """Nothing at a crossing: the rank walks its own stages' graphs at the end."""

    def _check_graph(self, outputs: list[tuple[Tensor, int]]) -> None:
        """The own stages' graphs are their own: from what each returns and hands on to its
        parameters and the leaves it received."""
        mine = self.mine
        roots = [(t, s) for t, s in outputs if s in mine and not t.is_meta]
        roots += [(c.original, c.producer) for c in self.exports if not c.original.is_meta]
        crossings = [c for c in self.ledger.crossings if c.consumer in mine]
        roots += [(c.original, c.producer) for c in crossings if c.producer in mine]
        leaves = self.alias_stages() | {id(c.leaf): c.consumer for c in crossings}
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
        if self.stage not in self.mine:
            own_value = made in self.mine and not t.is_meta
            if own_value or (t.is_meta and made not in (None, self.stage)):
                self.loose = True  # a crossing in the model's own code: no route
            return self._shadow(t)
        if t.is_meta:
            self.loose = True
            return self._receive(t)
        held = self.owner.get(id(t), self.stage) if isinstance(t, nn.Parameter) else None
        if (made in self.mine and made != self.stage) or held not in (None, self.stage):
            self.loose = True  # another own stage's value or weight: handed over here
            return super()._cross(t)
        return t

    def _shadow(self, t: Tensor) -> Tensor:
        """What a shadow stage computes with: meta tensors. A real value of an own stage is
        sent to the stage's rank the first time that stage uses it, and so is an own stage's
        weight in no unit that a later stage uses without holding it (:class:`WeightStages`)."""
        if t.is_meta:
            return t
        producer = self.ledger.stage_of(t)
        if producer is None and isinstance(t, nn.Parameter):
            producer = self.weights.lent(t, self.stage)
            if producer is not None:
                self.loose = True
                self._export(self._lent_view(t), producer, self.stage)
                return self._meta_of(t)
        self._export(t, producer, self.stage)
        return self._meta_of(t)

    def _lent_view(self, weight: Tensor) -> Tensor:
        found = self._lent.get(id(weight))
        if found is None:
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                found = self._lent[id(weight)] = weight.view_as(weight)
        return found

    def _meta_of(self, t: Tensor) -> Tensor:
        found = self._metas.get(id(t))
        if found is None or found[0] is not t:
            with torch._C._DisableTorchDispatch():  # its value is told here, not followed
                meta = t.to("meta")
                if not t.is_floating_point() and t.numel() <= SHADOW_LIMIT:
                    self.values.know(meta, t.detach().cpu())
            found = self._metas[id(t)] = (t, meta)
        return found[1]

    def _twin(self, t: Tensor) -> Tensor:
        """The meta twin of a real tensor a shadow stage made from no tensor (a constant),
        its value known to the shadow's reads."""
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            meta = t.detach().to("meta")
            if t.requires_grad:
                meta.requires_grad_()
            if t.numel() <= SHADOW_LIMIT:
                self.values.know(meta, t.detach().cpu())
        return meta

    def _receive(self, t: Tensor) -> Tensor:
        """The real value of shadow value ``t`` from the rank of the stage that made it."""
        made = self.ledger.stage_of(t)
        if made is None and isinstance(t, nn.Parameter) and t.is_meta:
            made = self.weights.lent(t, self.stage)
        if made is None and isinstance(t, nn.Parameter) and t.is_meta:
            raise RuntimeError(
                f"stage {self.stage} uses the weight {self._name_of(t)} (shape "
                f"{tuple(t.shape)}) that a stage on another rank holds, inside stage "
                f"{self.stage}'s stretch of the forward (typically a module declared after "
                "the ones it runs before, or a unit of an earlier stage called again after this "
                "stage began). Across ranks a stage's weights live on its own rank only, so "
                "each stage's units must run in one stretch, in the order pipepar.units(model) "
                "lists them: pass sample=<a batch> to pipepar.distributed.wrap to lay the units "
                "out in the order the forward calls them, declare the modules in that order, "
                "move the split, or use pipepar.wrap in one process (which allows it)"
            )
        if made is None:
            raise RuntimeError(
                f"stage {self.stage} uses a value of shape {tuple(t.shape)} that no stage made "
                "in this micro-batch (kept from an earlier call?); pipepar cannot send it"
            )
        return self.ledger.leaf_from(t, made, self.stage, lambda: self._recv(t, made))

    def _name_of(self, weight: Tensor) -> str:
        """``weight``'s name in the model, for messages."""
        named = () if self.model is None else self.model.named_parameters()
        return next((repr(name) for name, p in named if p is weight), "(not the model's)")

    def _recv(self, t: Tensor, made: int) -> Tensor:
        kept = self._received(t, self.stage)
        if kept is None:
            kept = self.link.recv(t, ACTIVATION, made, self.stage)
        return _leaf(kept, t)


@dataclass(frozen=True)
class WeightStages:
    """Which stages hold the model's weights (by ``id``, the weights on ``meta`` too):
    ``holder``, for each weight in no unit (the model's own, a ViT's class token), the stage
    that holds it for the others; ``users``, for every weight, the stages whose units (or
    loose weights) it is in, each of which has it on its rank; ``rank_of``, each stage's rank.

    A stage may use a weight it does not hold in the model's own code: CLIP's
    ``logit_scale``, the model's own weight and so held by stage 0, scales the logits at
    the end. A weight of an earlier stage then travels as a value that stage made, sent by
    its rank on the later stage's first use of it in a micro-batch, its gradient sent back
    and added to the weight's in the holder's backward. A weight of a later stage (DeBERTa-v2
    reads ``rel_embeddings.weight``, registered after the layers, before them) would have to
    travel against the pipeline, its gradient awaited by a backward that runs before the
    user's: the user's rank refuses it, naming it."""

    holder: Mapping[int, int]
    users: Mapping[int, frozenset[int]]
    rank_of: Sequence[int] = ()

    def lent(self, weight: Tensor, stage: int) -> int | None:
        """The earlier stage that lends ``weight`` to ``stage``, or None (``stage``'s rank
        has it, or a later stage holds it)."""
        holder = self.holder.get(id(weight))
        if holder is None or holder >= stage:
            return None
        here = self.rank_of[stage]
        if any(self.rank_of[s] == here for s in self.users.get(id(weight), ())):
            return None
        return holder


def _leaf(value: Tensor, like: Tensor) -> Tensor:
    """A received ``value`` as the leaf of shadow value ``like``: needing a gradient if it
    does."""
    if like.requires_grad and value.is_floating_point():
        value.requires_grad_()
    return value


class RankStep(SegmentStep):
    """An own stage's F, B and W on a rank of the stages ``mine``: F runs the forward on to
    the rank's next own stage (the stages between in shadow), B receives the gradients of what
    the stage sent, and hands those of what it received to the own stage that made it or sends
    them to its rank."""

    def __init__(
        self,
        *args: Any,
        cuts: Sequence[RankCut],
        link: RankMessages,
        mine: Collection[int],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.cuts, self.link, self.mine = cuts, link, frozenset(mine)
        later = [s for s in self.mine if s > self.stage.index]
        self.until = min(later) - 1 if later else len(link.ranks) - 1
        self._foreign = frozenset(range(len(link.ranks))) - self.mine
        self._waited = 0.0  # link.waited when the running action started

    def forward(self, i: int, x: Any) -> tuple[()]:
        start = time.perf_counter()
        self._action_starts("F", i)
        self.batch.drivers[i].advance(self.until)
        self._tell(i, "forward", start)
        return ()

    def backward(self, i: int, grads: Any) -> tuple[()]:
        start = time.perf_counter()
        self._action_starts("B", i)
        ledger = self.batch.ledgers[i]
        pairs = self._leaving(i)
        entering = ledger.entering(self.stage.index)
        grads_in: Sequence[Tensor | None] = [None] * len(entering)
        if pairs:
            grads_in = self._backward(i, pairs, [c.leaf for c in entering])
        elif self.grad:
            self._closing()
        here = [(c, g) for c, g in zip(entering, grads_in) if c.producer in self.mine]
        self._deliver(ledger, [c for c, _ in here], [g for _, g in here])
        for crossing, g in zip(entering, grads_in):
            if crossing.producer not in self.mine:
                sent = g if g is not None else torch.zeros_like(crossing.leaf)
                self.link.send(sent, GRADIENT, crossing.producer, self.stage.index)
        self._backward_ran(i)
        self._tell(i, "backward", start)
        return ()

    def _action_starts(self, kind: str, i: int) -> None:
        self._waited = self.link.waited  # what the link waited before this action
        super()._action_starts(kind, i)

    def _tell(self, i: int, kind: str, start: float) -> None:
        """Report the action's own computation: its duration less the time the link waited
        for messages meanwhile (an activation a forward receives from another rank, the
        gradients a backward receives), which another rank's speed decides, not this
        stage's."""
        if self.record is not None:
            end = time.perf_counter() - (self.link.waited - self._waited)
            self.record(self.stage.index, i, kind, start, max(end, start))

    def _finished(self, i: int) -> None:
        super()._finished(i)
        s = self.stage.index
        self.batch.ledgers[i].drop_grads([c.original for c in self.cuts[i].exports
                                          if c.producer == s])  # fmt: skip
        self.cuts[i].release(s)

    def defers_weights(self, i: int) -> bool:
        """Whether B of micro-batch ``i`` will compute no weight gradient: nothing enters the
        stage with a gradient to give back, its backward splits and what it made has a
        graph, so its W runs the whole backward (an embedding's stage)."""
        s, ledger = self.stage.index, self.batch.ledgers[i]
        if not self.grad or ledger.entering(s) or not (self._saved_readable(i) and self.split(i)):
            return False
        made = [c.original for c in self.cuts[i].exports if c.producer == s]
        made += [c.original for c in ledger.crossings if c.producer == s]
        made += [t for p, t in ledger.outputs if p == s]
        return all(t.grad_fn is not None for t in made if t.requires_grad)

    def gradients_arrived(self, i: int) -> bool:
        """Whether every gradient B of micro-batch ``i`` takes from other ranks is here."""
        s = self.stage.index
        return all(
            self.link.arrived(c.original, s, c.consumer)
            for c in self.cuts[i].exports
            if c.producer == s and c.original.requires_grad
        )

    def _leaving(self, i: int) -> list[tuple[Tensor, Tensor]]:
        """``(value, gradient)`` for what the stage made that got a gradient: sent to other
        ranks (their gradients received now), handed to own stages, or the loss."""
        ledger, s = self.batch.ledgers[i], self.stage.index
        sent = [c for c in self.cuts[i].exports if c.producer == s and c.original.requires_grad]
        for c in sent:
            ledger.add_grad(c.original, self.link.recv(c.original, GRADIENT, s, c.consumer))
        pairs = ledger.leaving(s)
        known = {id(t) for t, _ in pairs}
        for c in sent:
            if id(c.original) not in known:  # one value may go to several stages
                known.add(id(c.original))
                pairs.append((c.original, ledger.grads[id(c.original)]))
        return pairs


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
