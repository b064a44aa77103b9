"""Cut a model's own forward code into stages while it runs, one micro-batch at a time.

The model's ``forward`` runs unchanged. Every torch operation it makes passes through
:class:`Cut` (a torch-function mode) which knows the stage currently computing. Each tensor an
operation returns is tagged with that stage. When an operation of stage ``c`` is given a tensor
of an earlier stage ``p`` (the hidden state, but also a residual stream, an attention mask, a
rotary table, a class token or a U-Net skip: whatever the code passes along), the cut gives it a
detached copy instead: a leaf of stage ``c``'s own autograd graph, on stage ``c``'s device. So
each stage owns a small autograd graph per micro-batch, exactly as a stage of an
``nn.Sequential`` does, and the values that cross a boundary are found without the user naming
them.

A parameter used by a stage other than the one holding it (tied weights: an embedding reused by
the output head) is cut the same way: the user stage computes with a leaf alias and hands the
gradient to the holder, which adds it to the parameter's own.

The :class:`Ledger` of a micro-batch remembers each crossing (the original tensor, the leaf) so
the backward of a stage knows which of its tensors receive gradients and from where.

The units' hooks (:func:`pipepar.program.driver.watch_units`) make the crossings that happen at
a unit's arguments themselves, and a tied weight's at the unit that holds a second reference to
it; the mode only finds the others. When it finds none, the hooks' record is a
:class:`~pipepar.program.route.Route`, and later calls of the same kind run without the mode,
the hooks alone making the same crossings (:meth:`Cut.following`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipepar.batching.calls import Call
from pipepar.core.forms import op_name
from pipepar.core.split_backward import NextNodes
from pipepar.program.aliases import Aliases
from pipepar.program.driver import Weight
from pipepar.program.kept_state import (
    METADATA,
    REPLACED,
    SHAPE_ONLY,
    holds,
    kept_state,
    saved_with_weights,
    use_of,
    where_held,
)
from pipepar.program.route import (
    GraphCheck,
    PathChanged,
    Route,
    Routes,
    UnitCall,
    replaced,
    tensors_in,
)

__all__ = ["CALLER", "Crossing", "Cut", "Ledger", "map_arguments", "row_ledgers", "tag_stage"]

CALLER = -1
"""The producer of the pipe's own tensor arguments (their gradients go back to the caller)."""

_TAG = "_pipepar_stage"


@dataclass
class Crossing:
    """One value entering stage ``consumer`` from ``producer``: the original and its leaf."""

    producer: int
    consumer: int
    original: Tensor
    leaf: Tensor
    is_param: bool = False


@dataclass
class Ledger:
    """What crossed stage boundaries in one micro-batch, and the gradients found for it."""

    token: object = field(default_factory=object)
    crossings: list[Crossing] = field(default_factory=list)
    _leaves: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    # Gradients of originals, summed over their consumers (keyed by id; originals are held
    # by their crossing, so ids stay valid).
    grads: dict[int, Tensor] = field(default_factory=dict)
    outputs: list[tuple[int, Tensor]] = field(default_factory=list)
    walked: dict[int, NextNodes] = field(default_factory=dict)
    """Per stage, its graph's nodes as the route's check walked them (with their next nodes),
    for the stage's backward planning to take (:meth:`take_walked`) instead of reading again."""
    _releasing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Two stages of the micro-batch may end their backward at once, on two workers (an idle
    worker runs another stage's W): their releases take turns."""

    def take_walked(self, stage: int) -> NextNodes | None:
        """Stage ``stage``'s walked nodes, handed over once (they are let go of with the plan
        that reads them, not kept to the mini-batch's end)."""
        return self.walked.pop(stage, None)

    def leaf(
        self, t: Tensor, producer: int, consumer: int, device: torch.device, is_param: bool
    ) -> Tensor:
        """The leaf standing for ``t`` in stage ``consumer`` (one per value and stage): a
        detached copy on ``device``, needing a gradient when ``t`` does."""
        return self.leaf_from(t, producer, consumer, lambda: _detached(t, device), is_param)

    def leaf_from(
        self,
        t: Tensor,
        producer: int,
        consumer: int,
        make: Callable[[], Tensor],
        is_param: bool = False,
    ) -> Tensor:
        """The leaf standing for ``t`` in stage ``consumer``: ``make()`` on the stage's first
        use of ``t`` (a copy, or the value received from the rank that made it), recorded as
        the crossing from ``producer``; the same leaf on every later use."""
        key = (id(t), consumer)
        found = self._leaves.get(key)
        if found is None:
            found = make()
            setattr(found, _TAG, (self.token, consumer, self.of_rows(t)))
            self._leaves[key] = found
            self.crossings.append(Crossing(producer, consumer, t, found, is_param))
        return found

    def has(self, t: Tensor, consumer: int) -> bool:
        """Whether stage ``consumer`` has used ``t`` before (it has a leaf for it)."""
        return (id(t), consumer) in self._leaves

    def leaf_of(self, t: Tensor, consumer: int) -> Tensor | None:
        """The leaf standing for ``t`` in stage ``consumer``, if it has one."""
        return self._leaves.get((id(t), consumer))

    def first_use(self, t: Tensor, consumer: int) -> bool:
        """Whether this is stage ``consumer``'s first use of ``t``, noting the use. For a stage
        computed elsewhere (another rank), which is sent ``t`` once and makes its leaf there:
        no leaf or crossing is recorded here."""
        key = (id(t), consumer)
        if key in self._leaves:
            return False
        self._leaves[key] = t
        return True

    def add_grad(self, original: Tensor, grad: Tensor) -> None:
        key = id(original)
        if grad.device != original.device:
            grad = grad.to(original.device)
        total = self.grads.get(key)
        self.grads[key] = grad if total is None else total + grad

    def entering(self, consumer: int) -> list[Crossing]:
        """The crossings into ``consumer`` whose leaf needs a gradient."""
        return [c for c in self.crossings if c.consumer == consumer and c.leaf.requires_grad]

    def leaving(self, producer: int) -> list[tuple[Tensor, Tensor]]:
        """``(original, gradient)`` for the values ``producer`` made that got a gradient."""
        pairs, seen = [], set()
        sources = [c.original for c in self.crossings if c.producer == producer]
        sources += [t for p, t in self.outputs if p == producer]
        for t in sources:
            g = self.grads.get(id(t))
            if g is not None and id(t) not in seen and t.requires_grad and not _is_leaf_param(t):
                seen.add(id(t))
                pairs.append((t, g))
        return pairs

    def stage_of(self, t: Tensor) -> int | None:
        """The stage that made ``t`` in this micro-batch, or None."""
        tag = getattr(t, _TAG, None)
        return tag[1] if tag is not None and tag[0] is self.token else None

    def take_rows(self, rows: Sequence[Tensor]) -> None:
        """Mark ``rows`` (the pipe's tensor arguments holding this micro-batch's rows) as this
        micro-batch's, made by no stage: what is computed from them is of its rows."""
        for t in rows:
            if self.stage_of(t) is None:
                _set_tag(t, (self.token, None, True))

    def of_rows(self, t: Tensor) -> bool:
        """Whether ``t`` was computed from this micro-batch's rows (or is one of them)."""
        tag = getattr(t, _TAG, None)
        return tag is not None and tag[0] is self.token and tag[2]

    def of_other_rows(self, t: Tensor) -> bool:
        """Whether ``t`` was computed from another micro-batch's rows (of this call or an
        earlier one): a state kept between micro-batches."""
        tag = getattr(t, _TAG, None)
        return tag is not None and tag[0] is not self.token and bool(tag[2])

    def release(self, producer: int, *, received: Collection[int] = ()) -> None:
        """Let go of the values stage ``producer`` made (they hold its graph) once its
        backward is done: each stage they fed has run its B, so neither their gradients nor
        the leaves standing for them are asked for again; and of the values it received from
        the stages ``received`` (on other ranks: its B sent their gradients). Weights stay (a
        stage may hold one that an earlier stage uses)."""

        def made(c: Crossing) -> bool:
            return c.producer == producer and not c.is_param

        def taken(c: Crossing) -> bool:
            return c.consumer == producer and c.producer in received and not c.is_param

        with self._releasing:
            gone = {id(c.original) for c in self.crossings if made(c)}
            gone.update(id(t) for p, t in self.outputs if p == producer)
            self.crossings = [c for c in self.crossings if not (made(c) or taken(c))]
            self.outputs = [(p, t) for p, t in self.outputs if p != producer]
            # The leaves of the stage's values, and the stage's own leaves (tagged as its: the
            # received ones among them); a value sent to another rank's stage is noted under
            # its own tag (:meth:`first_use`).
            for pair in [
                k for k, v in self._leaves.items() if k[0] in gone or self.stage_of(v) == producer
            ]:
                del self._leaves[pair]
            for key in gone:
                self.grads.pop(key, None)

    def drop_grads(self, originals: Collection[Tensor]) -> None:
        """Let go of the gradients found for ``originals``: values a stage sent to another
        rank's stages (recorded by the rank's cut, not as crossings here), once the stage's
        backward has used them; kept, each would hold a micro-batch's gradient to the
        mini-batch's end."""
        with self._releasing:
            for t in originals:
                self.grads.pop(id(t), None)

    def forget(self) -> None:
        self.crossings.clear()
        self._leaves.clear()
        self.grads.clear()
        self.outputs.clear()
        self.walked.clear()


def _detached(t: Tensor, device: torch.device) -> Tensor:
    leaf = t.detach()
    if leaf.device != device:
        leaf = leaf.to(device)
    if t.requires_grad:
        leaf.requires_grad_()
    return leaf


def _is_leaf_param(t: Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter)


class Cut(TorchFunctionMode):
    """The torch-function mode of one micro-batch's forward: tags what each stage makes and
    hands each stage leaves for what earlier stages (or other stages' parameters) give it.

    Args:
        ledger: the micro-batch's crossings.
        owner: the stage holding each parameter, by ``id``.
        devices: each stage's device.
        inputs: the pipe's own tensor arguments for this micro-batch, by ``id`` (they cross
            from :data:`CALLER` when they need a gradient).
        routes: where a learned route is kept, under ``key`` (None: always run under the mode).
        key: this call's :func:`~pipepar.program.route.signature`.
        aliases: the mini-batch's alias of each weight a stage uses and another holds
            (:mod:`pipepar.program.aliases`); a weight without one gets a leaf per micro-batch.
        model: the model, looked through for a state kept on it
            (:mod:`pipepar.program.kept_state`) at the end of a forward under the mode.
    """

    def __init__(
        self,
        ledger: Ledger,
        owner: dict[int, int],
        devices: list[torch.device],
        inputs: dict[int, Tensor],
        routes: Routes | None = None,
        key: Hashable = None,
        aliases: Aliases | None = None,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.ledger, self.owner, self.devices, self.inputs = ledger, owner, devices, inputs
        self.model = model
        self.aliases: Aliases = aliases if aliases is not None else {}
        self.stage = 0
        self.routes, self.key = routes, key
        self.route = routes.get(key) if routes is not None else None
        # Whether an earlier call of this kind left a state on the model (read when the call
        # starts: a micro-batch of this call may leave one before another ends).
        self._waited = routes.waited(key) if routes is not None else False
        self.record = Route()
        self.loose = False  # the mode made a crossing the hooks did not: the route is not whole
        self._seen = 0
        self._swapped: list[list[tuple[Weight, nn.Parameter]]] = []
        self._open: list[int] = []  # the unit calls entered and not left, by route index
        self._graphs = GraphCheck(owner, key)  # the check of a followed route's graphs
        self._moved: dict[int, tuple[Tensor, Tensor]] = {}  # caller's values copied to a stage
        self._func: Callable[..., Any] | None = None  # the operation whose arguments are read
        self._args: tuple[Any, ...] = ()  # its positional arguments
        self._rows_in = False  # one of them holds the micro-batch's rows
        self._made_rows = False  # so what it returned does
        self._kept_read = False  # one of them is a kept state, read for its shape or updated

    @property
    def following(self) -> bool:
        """Whether this call follows a learned route (the mode is not entered)."""
        return self.route is not None

    def done(self) -> bool:
        """Whether the rest of the forward is no business of this process (never, in one
        process: every stage computes here)."""
        return False

    def stub(self) -> Callable[[], Any] | None:
        """What stands in for the unit call just entered (never, in one process: every unit
        runs here)."""
        return None

    def running(self) -> contextlib.AbstractContextManager[Any]:
        """What the micro-batch's forward runs under: the mode, unless it follows a route."""
        return contextlib.nullcontext() if self.following else self

    # -- at a unit's arguments (its hooks) ------------------------------------------------------
    def enter_unit(
        self, unit: int, weights: Sequence[Weight], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Before unit ``unit`` runs in the current stage: alias the weights it holds that
        another stage holds, and give it leaves for the values of other stages in its
        arguments (those the route names, when following one). Returns the new arguments, or
        None if none changed."""
        with torch._C.DisableTorchFunction():  # the hooks' own work is not the model's
            return self._enter_unit(unit, weights, args, kwargs)

    def _enter_unit(
        self, unit: int, weights: Sequence[Weight], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        stage = self.stage
        self._alias(weights, stage)
        flat = tensors_in(args, kwargs)
        if self.route is None:
            crossings = [(j, p) for j, t in enumerate(flat) if (p := self._producer(t)) is not None]
            self.record.calls.append(UnitCall(unit, len(flat), tuple(crossings)))
        else:
            crossings = self._expected(unit, flat)
        self._open.append(len(self.record.calls) - 1 if self.route is None else self._seen - 1)
        if self._skipped(bool(weights), flat, crossings, stage):
            return None
        subs = self._enter_all(flat, crossings, stage)
        for j, t in enumerate(flat):
            if j not in subs and (placed := self._placed(t, stage)) is not t:
                subs[j] = placed
        return replaced(args, kwargs, subs) if subs else None

    def _skipped(
        self, weighted: bool, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> bool:
        """Whether the unit call just entered does not run here (never, in one process), after
        making what it needs all the same (a rank's sends to another)."""
        return False

    def leave_unit(self, output: Any) -> None:
        """After a unit ran (or failed): its weights back, its outputs tagged with the stage."""
        for (module, name, _), param in self._swapped.pop() if self._swapped else ():
            module._parameters[name] = param
        if self._open:
            self._open.pop()
        if self.route is not None:
            self._tag(output if isinstance(output, (Tensor, tuple, list)) else ())

    def finish(self, output: Any) -> None:
        """After the micro-batch's forward: keep what it took as the route of its kind (when
        the hooks made every crossing), or check that it took the route it followed and tag
        its outputs with their stages."""
        leaves = pytree.tree_leaves(output)
        if self.route is None:
            if self.routes is not None and not self.loose and self._first_to_keep():
                self.routes.wait(self.key)  # the next call may read it: under the mode
            elif self.routes is not None and not self.loose:
                stages = (
                    (k, s)
                    for k, t in enumerate(leaves)
                    if isinstance(t, Tensor) and (s := self.ledger.stage_of(t)) is not None
                )
                self.record.outputs = tuple(stages)
                self.routes.learned(self.key, self.record)
            return
        if self._seen != len(self.route.calls):
            self._changed(f"{self._seen} unit calls where the route has {len(self.route.calls)}")
        roots = []
        for k, s in self.route.outputs:
            if k >= len(leaves) or not isinstance(leaves[k], Tensor):
                self._changed(f"output leaf {k} is not a tensor")
            _set_tag(leaves[k], (self.ledger.token, s, False))
            roots.append((leaves[k], s))
        if torch.is_grad_enabled():
            self._check_graph(roots)
            self.ledger.walked = self._graphs.walked()
            self._graphs.forget()

    def _first_to_keep(self) -> bool:
        """Whether the model holds a tensor computed from a micro-batch's rows (a state kept
        on itself) and no earlier call of this kind left one: the next call may read it, so
        it runs under the mode too. Once a call ran under the mode with such a state there
        and used none of its values, its kind follows a route as any other."""
        if self.model is None or self._waited:
            return False
        return holds(self.model, _kept_rows)

    def _check_graph(self, outputs: list[tuple[Tensor, int]]) -> None:
        """Each stage's graph is its own (:func:`~pipepar.program.route.check_graphs`): the
        outputs, and the crossing values not walked when they crossed."""
        crossings = self.ledger.crossings
        roots = outputs + [(c.original, c.producer) for c in crossings if c.producer != CALLER]
        entering = self._entering()
        for tensor, stage in roots:
            self._graphs.walk(tensor, stage, entering)

    def _entering(self) -> dict[int, int]:
        """The stage each leaf made so far enters (aliases and crossing leaves), by ``id``."""
        return self.alias_stages() | {id(c.leaf): c.consumer for c in self.ledger.crossings}

    def _check_crossing(self, t: Tensor, producer: int) -> None:
        """Walk the graph of ``t``, crossing out of ``producer`` now, if the call follows a
        route and will run a backward: the producer's part of the check at the micro-batch's
        end, done here on the consumer's worker (the last stage's worker does the rest)."""
        if t.grad_fn is None:  # nothing to walk (a mask, a rotary table): no leaf map either
            return
        if self.route is not None and producer != CALLER and torch.is_grad_enabled():
            self._graphs.walk(t, producer, self._entering())

    def original_of(self, t: Tensor) -> Tensor | None:
        """The value a stage's leaf (or a copy on its device) stands for, if ``t`` is one."""
        for c in self.ledger.crossings:
            if c.leaf is t:
                return c.original
        moved = self._moved.get(id(t))
        return moved[1] if moved is not None and moved[0] is t else None

    def alias_stages(self) -> dict[int, int]:
        """The stage using each alias, by the alias's ``id`` (a leaf of that stage)."""
        return {id(leaf): s for (_, s), leaf in self.aliases.items()}

    def _alias(self, weights: Sequence[Weight], stage: int) -> None:
        swapped = []
        for weight in weights:
            module, name, param = weight
            holder = self.owner.get(id(param), stage)
            if holder != stage:
                leaf = self._stand_in_for(param, holder, stage)
                module._parameters[name] = leaf  # type: ignore[assignment]
                swapped.append((weight, param))
        self._swapped.append(swapped)

    def _stand_in_for(self, param: Tensor, holder: int, stage: int) -> Tensor:
        """What ``stage`` computes with for weight ``param`` that stage ``holder`` holds: its
        alias for the mini-batch, or a leaf of this micro-batch."""
        alias = self.aliases.get((id(param), stage))
        if alias is not None:
            return alias
        return self.ledger.leaf(param, holder, stage, self.devices[stage], is_param=True)

    def _producer(self, t: Tensor) -> int | None:
        """The stage ``t`` crosses from into the current stage, or None if it does not cross."""
        if isinstance(t, nn.Parameter):
            return None
        made = self.ledger.stage_of(t)
        if made is None:
            return CALLER if t.requires_grad and id(t) in self.inputs else None
        return made if made != self.stage else None

    def _expected(self, unit: int, flat: list[Tensor]) -> list[tuple[int, int]]:
        """The crossings the route has at this unit call, checking the call is the route's."""
        assert self.route is not None
        k = self._seen
        self._seen += 1
        calls = self.route.calls
        if k >= len(calls) or calls[k].unit != unit or calls[k].n_tensors != len(flat):
            self._changed(f"unit call {k} is unit {unit} with {len(flat)} tensor arguments")
        crossings = calls[k].crossings
        planned = {j for j, _ in crossings}
        for j, t in enumerate(flat):
            made = self.ledger.stage_of(t)
            if j not in planned and made is not None and made != self.stage:
                self._changed(f"unit {unit} is given an output of stage {made}")
        return list(crossings)

    def _enter_all(
        self, flat: list[Tensor], crossings: Sequence[tuple[int, int]], stage: int
    ) -> dict[int, Tensor]:
        """What stands for each crossing ``(j, producer)`` of a unit call's tensors ``flat``
        in ``stage``, by ``j``."""
        return {j: self._enter(flat[j], p, stage) for j, p in crossings}

    def _enter(self, t: Tensor, producer: int, stage: int) -> Tensor:
        """The leaf standing for ``t`` of stage ``producer`` in ``stage``."""
        leaf = self.ledger.leaf(t, producer, stage, self.devices[stage], is_param=False)
        self._check_crossing(t, producer)
        return leaf

    def _placed(self, t: Tensor, stage: int) -> Tensor:
        """``t`` on ``stage``'s device (a value that crosses no stage: the caller's)."""
        device = self.devices[stage]
        if t.device == device or _cpu_scalar(t):
            return t
        if self.route is not None:
            return t.to(device)
        return self._move(t, device)

    def _move(self, t: Tensor, device: torch.device) -> Tensor:
        """``t`` copied to ``device``, the copy remembered as standing for it (first calls)."""
        moved = t.to(device)
        self._moved[id(moved)] = (moved, t)
        return moved

    def _changed(self, why: str) -> None:
        raise PathChanged(self.key, why)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self._func, self._args, self._rows_in, self._kept_read = func, args, False, False
        try:
            args = tuple(self._sub(a) for a in args)
            if kwargs:
                kwargs = {k: self._sub(v) for k, v in kwargs.items()}
        finally:
            self._args = ()  # held no longer than the operation (they hold its graph)
        out = func(*args, **(kwargs or {}))
        self._made_rows = self._rows_in and func not in SHAPE_ONLY
        if not self._kept_read:  # a kept state read for its shape or updated in place stays
            # the other micro-batch's (a later use of its values is refused)
            self._tag(out, self._made_rows)
        return out

    def _sub(self, value: Any) -> Any:
        return map_arguments(value, self._used)

    def _used(self, t: Tensor) -> Tensor:
        """``t`` as the operation uses it (:meth:`_crossed`), noting whether it holds the
        micro-batch's rows; refused when it was computed from another micro-batch's rows (a
        state the model keeps on itself) and the operation reads its values."""
        tag = getattr(t, _TAG, None)  # read once (:meth:`Ledger.of_rows`, ``of_other_rows``)
        if tag is not None and tag[2]:
            if tag[0] is not self.ledger.token:
                return self._use_kept(t)
            self._rows_in = True
        return self._crossed(t)

    def _use_kept(self, t: Tensor) -> Tensor:
        """What the operation at hand uses for ``t``, a state another micro-batch made, if it
        reads none of its values (noting whether ``t`` stays that micro-batch's): ``t`` itself
        for a read of its metadata (nothing to hand over: across ranks, its shape on ``meta``
        is as good); else refused."""
        use = self._use_of(t)
        if use is None:
            if saved_with_weights(self.model, t):  # a running statistic, read as the plain
                return self._crossed(t)  # model reads it after its earlier calls
            raise kept_state(t, self.stage, where_held(self.model, t))
        self._kept_read = self._kept_read or use != REPLACED
        return t if self._op_name() in METADATA else self._crossed(t)

    def _use_of(self, t: Tensor) -> str | None:
        """How the operation at hand uses ``t`` (:func:`~pipepar.program.kept_state.use_of`):
        None when it reads its values."""
        return use_of(self._op_name(), self._func, t, self._args)

    def _op_name(self) -> str:
        """The operation at hand's name, as :func:`~pipepar.core.forms.op_name` spells it."""
        return op_name(self._func) if self._func is not None else ""

    def _crossed(self, t: Tensor) -> Tensor:
        out = self._cross(t)
        if out is not t:
            self.loose = True
        return out

    def _cross(self, t: Tensor) -> Tensor:
        s = self.stage
        device = self.devices[s]
        if isinstance(t, torch.nn.Parameter):
            holder = self.owner.get(id(t), s)
            if holder == s:
                return t
            return self._stand_in_for(t, holder, s)
        made = self.ledger.stage_of(t)
        if made is None:
            if t.requires_grad and id(t) in self.inputs:
                return self.ledger.leaf(t, CALLER, s, device, is_param=False)
            if t.grad_fn is not None and torch.is_grad_enabled():
                if self._use_of(t) is not None:  # no value read: no gradient flows
                    return t
                raise _untracked(t, s)
            return t if t.device == device or _cpu_scalar(t) else self._move(t, device)
        if made == s:
            return t
        return self.ledger.leaf(t, made, s, device, is_param=False)

    def _tag(self, out: Any, rows: bool = False) -> None:
        """Mark what an operation returned as the current stage's (computed from the
        micro-batch's ``rows``, or not)."""
        tag = (self.ledger.token, self.stage, rows)
        if isinstance(out, Tensor):
            _set_tag(out, tag)
        elif isinstance(out, (list, tuple)):
            for t in out:
                if isinstance(t, Tensor):
                    _set_tag(t, tag)


def map_arguments(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``fn`` applied to an operation's argument ``value``: a tensor, or each tensor of a list
    or tuple of tensors (``torch.cat``'s); anything else as it is."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
        items = [fn(v) if isinstance(v, Tensor) else v for v in value]
        return type(value)(items) if isinstance(value, list) else tuple(items)
    return value


def _cpu_scalar(t: Tensor) -> bool:
    """A CPU scalar, which torch lets any device's operation take."""
    return t.dim() == 0 and t.device.type == "cpu"


def _untracked(t: Tensor, stage: int) -> RuntimeError:
    """A tensor with an autograd history that no torch operation of this micro-batch made:
    its gradient could not be routed to the stage that made it, so it is refused rather than
    silently losing that part of the gradient. (One computed from a micro-batch's rows is
    refused before, as a kept state: :func:`~pipepar.program.kept_state.kept_state`.)"""
    return RuntimeError(
        f"stage {stage} was given a tensor of shape {tuple(t.shape)} that needs a gradient but "
        f"was not made by a torch operation of this call (its autograd node is "
        f"{type(t.grad_fn).__name__}): a tensor the model keeps on itself from an earlier call "
        "or another micro-batch (made from its weights, a table kept between calls), or made "
        "outside torch's Python API. pipepar cannot route its gradient; compute it inside the "
        "model's forward, or .detach() it if it needs none"
    )


def row_ledgers(calls: Sequence[Call]) -> list[Ledger]:
    """A ledger per micro-batch call, holding the call's rows (:meth:`Ledger.take_rows`): its
    rows of the batch's tensors and of a key-value cache passed in (made by an earlier call,
    maybe, and given to this one: its own). A tensor given to several micro-batches (the
    caller's own micro-batches may share one) is no micro-batch's rows."""
    rows = [c.batch_tensors() + c.cache_tensors() for c in calls]
    counts = collections.Counter(id(t) for ts in rows for t in ts)
    ledgers = [Ledger() for _ in calls]
    for ledger, ts in zip(ledgers, rows):
        ledger.take_rows([t for t in ts if counts[id(t)] == 1])
    return ledgers


def tag_stage(t: Tensor, ledger: Ledger, stage: int, rows: bool = False) -> None:
    """Mark ``t`` as made by ``stage`` in ``ledger``'s micro-batch (from its rows, or not)."""
    _set_tag(t, (ledger.token, stage, rows))


def _kept_rows(t: Tensor) -> bool:
    """Whether ``t`` was computed from some micro-batch's rows (of any call)."""
    tag = getattr(t, _TAG, None)
    return tag is not None and tag[2]


def _set_tag(t: Tensor, tag: tuple[object, int | None, bool]) -> None:
    if isinstance(t, torch.nn.Parameter):
        return
    with contextlib.suppress(AttributeError, RuntimeError):  # a subclass with __slots__
        setattr(t, _TAG, tag)
