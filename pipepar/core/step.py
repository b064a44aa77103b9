"""One stage's work on the micro-batches of one mini-batch: F, B and W, the one implementation.

Every runtime calls these and nothing else to compute: the threaded executor of one process
(:mod:`pipepar.local.executor`), the rank executor (:mod:`pipepar.ranks.runtime`) and the
planner's measuring tool. Who calls them, when, and how values travel between stages is the
caller's business; a :class:`StageStep` only computes:

* :meth:`StageStep.forward` ``F(i)``: run the stage on micro-batch ``i`` from a fresh leaf, so
  the stage owns a small autograd graph per micro-batch; keep the graph, or only the input when
  the micro-batch is checkpointed (recomputed in backward). Random operators draw from the
  (stage, micro-batch) stream of :mod:`pipepar.core.randomness`, so a recompute replays them.
* :meth:`StageStep.rebuild` ``R(i)``: run a checkpointed micro-batch's stage again from its
  kept input, ahead of its backward, with the same random numbers and batch norms that count
  it once (as the recompute inside ``B`` does); ``B`` then finds the graph built.
* :meth:`StageStep.backward` ``B(i)``: the gradient of the stage input; the parameter gradients
  too, unless the schedule runs them later in ``W(i)`` (:mod:`pipepar.core.split_backward`).
* :meth:`StageStep.weight` ``W(i)``: the deferred parameter gradients.

Parameter gradients are summed over micro-batches in buffers of the step (in place from the
first one on when that is safe), and handed over by :meth:`StageStep.param_grads`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipepar.core import engine
from pipepar.core.backward_plans import BackwardPlans, plans_over
from pipepar.core.callers_modes import CallersModes
from pipepar.core.grad_mode import GradMode
from pipepar.core.losses import kept_loss
from pipepar.core.microbatch import Value, check_rows, map_tensors, tensors
from pipepar.core.offload_plan import Offloader
from pipepar.core.randomness import Randomness
from pipepar.core.recompute import recomputing, should_checkpoint
from pipepar.core.saved_hooks import SavedHooks
from pipepar.core.split_backward import (
    Adder,
    BackwardWalk,
    Direct,
    NextNodes,
    WeightWork,
    backward_whole,
    by_id,
    run_input,
)
from pipepar.core.stage import Stage

__all__ = ["LARGE_MATRIX", "Autocast", "Grads", "Recorder", "StageStep", "check_output"]

LARGE_MATRIX = 1 << 17
"""Elements from which a weight matrix's backward runs unsplit (input and weight gradients in
one call): the planner reads the same threshold."""
_CACHED = 1 << 20
"""Bytes of gradient sums that stay in a core's cache over a pass (see StageStep._summing)."""
Grads = tuple[Tensor | None, ...]
Recorder = Callable[[int, int, str, float, float], None]
"""``record(stage, microbatch, kind, start, end)``: told about each computation (tracing)."""
Head = Callable[[Value, int], Value]
"""Applied to the last stage's output of micro-batch ``i`` inside its graph (e.g. the loss)."""


@dataclass(frozen=True)
class Autocast:
    """The caller's autocast settings, re-entered on worker threads (they are thread-local)."""

    states: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> Autocast:
        kinds = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return cls(
            tuple((k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k))
        )

    def __call__(
        self, *, enabled: bool = True, cache: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """The caller's autocast; with ``enabled=False``, autocast off for the same devices.
        A backward runs with it off, as a plain backward outside the autocast does (inside
        it, autograd would compute a float32 graph's backward in the lower precision). A
        context off inside one on keeps the outer one's cast cache. ``cache=False``: each
        cast is used once and dropped (where the graphs save shared copies instead)."""
        if not self.states:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for kind, dtype in self.states:
            stack.enter_context(
                torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        return stack


@dataclass
class _Record:
    """What a stage keeps of one micro-batch's forward until its backward."""

    input: Value
    output: Value | None  # None when checkpointed: recomputed in backward


@dataclass
class _Later:
    """A backward whose B had nothing to compute (no stage input needs a gradient): W runs it
    whole, in one engine pass with the direct terms, as an unsplit backward would (freeing
    what the forward saved as it goes)."""

    outputs: list[Tensor]
    grads: list[Tensor]
    known: NextNodes | None = None  # the graph as a walk in the forward read it (W plans with it)


class _Sums:
    """One backward pass's side of the gradient sums (see :meth:`StageStep._summing`): a
    context that removes the pass's hooks, if it registered any, when the pass is over."""

    def __init__(
        self,
        step: StageStep,
        shared: Sequence[Tensor],
        final: Callable[[int, Tensor], None] | None,
    ) -> None:
        self.step, self.shared, self.final = step, shared, final
        self.fresh: list[int] = []
        self.hooked = False
        self.handles: list[Any] = []
        self._keep: set[int] | None = None

    def __enter__(self) -> _Sums:
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    @property
    def keep(self) -> set[int]:
        """The storages of the tensors the pass shares (its incoming gradients): a gradient
        in one of them is never summed into in place. Read on a sum's first gradient only."""
        if self._keep is None:
            self._keep = {t.untyped_storage().data_ptr() for t in self.shared}
        return self._keep

    def add(self, grads: Iterable[tuple[int, Tensor | None]]) -> None:
        """Sum the pass's (parameter index, gradient) pairs, unless hooks summed them
        already: those into sums of their own in one call (``torch._foreach_add_``, each sum
        and gradient added as ``add_`` adds them), the others one by one."""
        if self.hooked:
            return
        step = self.step
        sums, owned, final = step._sums, step._owned, self.final
        totals: list[Tensor] = []
        parts: list[Tensor] = []
        for k, g in grads:
            if g is None:
                continue
            total = sums[k]
            if total is not None and owned[k] and final is None and g.layout == _STRIDED:
                totals.append(total)
                parts.append(g)
            else:
                step._add(k, g, self)
        if totals:
            torch._foreach_add_(totals, parts)


class StageStep:
    """Stage ``stage``'s F, B and W for the ``m`` micro-batches of one mini-batch.

    Args:
        stage: the stage (its layers and device).
        m: micro-batches in the mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (recompute in backward).
        grad: whether a backward will follow (else forwards keep nothing).
        input_grad: whether the stage input needs a gradient (False on the first stage unless
            the caller's input requires grad).
        streams: how random operators draw (:mod:`pipepar.core.randomness`); ``None`` draws
            from the global generators with no replay (no recompute, or nothing random).
        split: ``split(i)`` is True if micro-batch ``i``'s parameter gradients wait for W.
        head: applied to the output inside the graph (the loss, on a last stage that owns it).
        record: told about each computation, for timelines.
        on_final: ``on_final(k, grad)`` hands over parameter ``k``'s final sum the moment the
            last backward action of the mini-batch makes it (while the rest of that backward
            still runs, e.g. to start averaging it over replicas); it is then no longer in
            :meth:`param_grads`.

    Example:
        >>> stage = Stage(0, 0, [torch.nn.Linear(2, 2)], torch.device("cpu"))
        >>> step = StageStep(stage, 1, checkpoint="never", grad=True, input_grad=True)
        >>> y = step.forward(0, torch.ones(1, 2))
        >>> dx = step.backward(0, (torch.ones(1, 2),))
        >>> [g.shape for g in step.param_grads()]
        [torch.Size([2, 2]), torch.Size([2])]
    """

    def __init__(
        self,
        stage: Stage,
        m: int,
        *,
        checkpoint: str,
        grad: bool,
        input_grad: bool,
        streams: Randomness | None = None,
        split: Callable[[int], bool] | None = None,
        head: Head | None = None,
        record: Recorder | None = None,
        on_final: Callable[[int, Tensor], None] | None = None,
        offload: Offloader | None = None,
    ) -> None:
        self.stage, self.m, self.checkpoint = stage, m, checkpoint
        self.offload = offload
        self.grad, self.input_grad, self.streams = grad, input_grad, streams
        self.flags = tuple(layer.training for layer in stage.layers)
        self.training = any(self.flags)
        self.autocast = Autocast.capture()
        self.saved_hooks = SavedHooks.capture()  # the caller's, on every thread (see there)
        self.modes = CallersModes.capture()  # the same
        self._contexts = (
            bool(self.autocast.states)
            or bool(self.saved_hooks)
            or bool(self.modes)
            or stage.device.type == "cuda"
        )
        """Whether a forward enters more than the random streams (:meth:`_context`)."""
        self._cast_cache = True
        """Whether a forward keeps autocast's cast cache (see :meth:`Autocast.__call__`)."""
        self.split = split or (lambda i: False)
        self.head, self.record, self.on_final = head, record, on_final
        self._closed = 0  # micro-batches whose last backward action ran
        self.params = stage.trainable()
        self._index = {id(p): k for k, p in enumerate(self.params)}
        self._sums: list[Tensor | None] = [None] * len(self.params)
        self._owned = [False] * len(self.params)
        self._records: dict[int, _Record] = {}
        self._weights: dict[int, WeightWork | _Later] = {}
        self._plans: BackwardPlans | None = None
        # An unsplit backward takes the direct route of split_backward (weight products summed
        # in place, no pass to add them) only where that saves more than the ~30 us of Python
        # per layer it costs to find them: with 2**17 weights in a matrix, it does.
        self._large = any(p.dim() == 2 and p.numel() >= LARGE_MATRIX for p in self.params)

    @functools.cached_property
    def _small(self) -> bool:
        """Whether the gradient sums fit in a core's cache: summed after a pass, not in hooks
        (see :meth:`_summing`). Asked first by a backward, after a subclass chose its
        :attr:`params`."""
        return sum(p.numel() * p.element_size() for p in self.params) <= _CACHED

    # -- F ------------------------------------------------------------------------------------
    def forward(self, i: int, x: Value) -> Value:
        """Run micro-batch ``i`` (already on the stage's device); return the detached output."""
        start = time.perf_counter()
        self._action_starts("F", i)
        leaf = _leaf(x, self.input_grad) if self.grad else x
        ckpt = self.grad and self.training and should_checkpoint(self.checkpoint, i, self.m)
        with self._forward_context(i, ckpt), GradMode(self.grad and not ckpt):
            if i == 0 and self.stage.watch is not None:  # a chain's new kind of input
                with self.stage.watch.watching(self.stage.index, leaf, self.m):
                    y = self._run(leaf, i)
            else:
                y = self._run(leaf, i)
        if self.grad:
            self._records[i] = _Record(leaf, None if ckpt else y)
            y = map_tensors(y, Tensor.detach) if self.head is None else kept_loss(y)
        self._tell(i, "forward", start)
        return y

    def _action_starts(self, kind: str, i: int) -> None:
        """Action ``kind`` of micro-batch ``i`` starts: the offload brings back what the
        action leads (:meth:`~pipepar.core.offload_plan.Offloader.before`)."""
        if self.offload is not None:
            self.offload.before(self.stage.index, kind, i)

    def _run(self, x: Value, i: int) -> Value:
        y = self.stage.run(self.stage.protect(x) if self.grad else x)
        if self.head is not None:  # the loss takes the output as it is: nothing joins it
            return self.head(y, i)
        return check_output(self.stage, x, y)

    def _forward_context(self, i: int, replay: bool) -> contextlib.AbstractContextManager[Any]:
        """:meth:`_context`, without a stack of contexts where there is at most one; and,
        where the offload plan sends micro-batch ``i`` out, what it saves goes to host memory
        (a checkpointed micro-batch, ``replay``, saves nothing to send)."""
        if self.offload is not None and self.grad and not replay:
            stack = self._context(i, replay=replay)
            saving = self.offload.saving(self.stage.index, i)
            stack.enter_context(saving)
            return stack
        if self._contexts:
            return self._context(i, replay=replay)
        if self.streams is None:
            return _NOTHING
        return self.streams.drawing(self.stage.index, i, replay=replay, flags=self.flags)

    def _context(self, i: int, *, replay: bool) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(self.modes())  # outermost, as around the plain model
        if self.streams is not None:
            drawing = self.streams.drawing(self.stage.index, i, replay=replay, flags=self.flags)
            stack.enter_context(drawing)
        if self.stage.device.type == "cuda":
            stack.enter_context(torch.cuda.device(self.stage.device))
        stack.enter_context(self.autocast(cache=self._cast_cache))
        stack.enter_context(self.saved_hooks())
        return stack

    # -- R ------------------------------------------------------------------------------------
    def rebuild(self, i: int) -> None:
        """Rebuild micro-batch ``i``'s graph from the input its forward kept (a listed ``R``),
        so that its backward need not; a no-op where the forward kept the graph or nothing."""
        rec = self._records.get(i)
        if rec is not None and rec.output is None:
            rec.output = self._recompute(rec, i)

    # -- B ------------------------------------------------------------------------------------
    def backward(self, i: int, grads: Grads) -> Grads:
        """Back-propagate micro-batch ``i`` from the gradients of its outputs (on the stage's
        device, ``None`` for outputs without one); return the input gradients, aligned with the
        input tensors (``None`` where an input needs none)."""
        start = time.perf_counter()
        self._action_starts("B", i)
        rec = self._records.pop(i)
        y = rec.output if rec.output is not None else self._recompute(rec, i)
        pairs = [(t, g) for t, g in zip(tensors(y), grads) if t.requires_grad and g is not None]
        xs = tensors(rec.input)
        inputs = [t for t in xs if t.requires_grad]
        grads_in: Sequence[Tensor | None] = [None] * len(inputs)
        if pairs:
            grads_in = self._backward(i, pairs, inputs)
        if len(grads_in) == len(inputs) == len(xs):  # every input took a gradient
            aligned = tuple(grads_in)
        else:
            it = iter(grads_in)
            aligned = tuple(next(it) if t.requires_grad else None for t in xs)
        self._backward_ran(i)
        self._tell(i, "backward", start)
        return aligned

    def _backward_ran(self, i: int) -> None:
        """B of micro-batch ``i`` has run: if it left no W, it was the last backward action."""
        if i not in self._weights:
            self._done(i)

    def _done(self, i: int) -> None:
        """Micro-batch ``i``'s last backward action on this stage has run."""
        self._finished(i)
        if self.offload is not None:
            self.offload.release(self.stage.index, i)

    def _backward(
        self, i: int, pairs: list[tuple[Tensor, Tensor]], inputs: list[Tensor]
    ) -> Sequence[Tensor | None]:
        outs, gouts = [t for t, _ in pairs], [g for _, g in pairs]
        readable = self._saved_readable(i)
        known = self._walked(i)  # taken in any case: kept no longer than this backward needs
        with self._backward_context():
            if readable and self.split(i) and all(t.grad_fn is not None for t in outs):
                if not inputs:  # B has nothing to compute: W runs the whole backward
                    self._weights[i] = _Later(outs, gouts, known)
                    return []
                plan = self._plan(outs, gouts, inputs, known=known)
                grads_in, work = run_input(plan, outs, gouts, inputs)
                if work is not None:
                    self._weights[i] = work
                    return grads_in
            last = self._closing()
            return self._whole(outs, gouts, inputs, last=last, readable=readable, known=known)

    def _plan(
        self,
        outs: list[Tensor],
        gouts: list[Tensor],
        inputs: list[Tensor],
        *,
        reach: bool = False,
        known: NextNodes | None = None,
    ) -> BackwardWalk:
        """:func:`~pipepar.core.split_backward.plan_backward` over the stage's parameters,
        made once per shape of graph and kept by the stage across mini-batches
        (:mod:`pipepar.core.backward_plans`)."""
        if self._plans is None:
            self._plans = self.stage.plans = plans_over(self.stage.plans, by_id(self.params))
        return self._plans.plan(outs, gouts, inputs, reach=reach, known=known)

    def _walked(self, i: int) -> NextNodes | None:
        """Micro-batch ``i``'s graph on this stage as an earlier walk read it, if one did
        (handed over once): its planning need not read it again."""
        return None

    def _saved_readable(self, i: int) -> bool:
        """Whether micro-batch ``i``'s graph holds what its operations saved, so that the
        B/W split and the direct weight products may read it. Not so where reading it
        recomputes a part of the forward (checkpointed units); the backward then runs whole,
        in one engine pass."""
        return True

    def _whole(
        self,
        outs: list[Tensor],
        gouts: list[Tensor],
        inputs: list[Tensor],
        *,
        last: bool,
        retain: bool = False,
        readable: bool = True,
        known: NextNodes | None = None,
    ) -> list[Tensor | None]:
        """The whole backward in one engine pass, parameter gradients summed as they come;
        a large stage's weight products are direct terms (:func:`backward_whole`) where what
        they read is ``readable`` (see :meth:`_saved_readable`); their plan reads the graph
        past what is ``known`` (:meth:`_walked`)."""
        large = self._large and readable
        plan = self._plan(outs, gouts, inputs, reach=True, known=known) if large else None
        direct = {id(p) for p in plan.direct_params()} if plan is not None else set()
        generic = [p for p in self.params if id(p) not in direct] if direct else self.params
        after = plan is None or not direct  # the pass returns every gradient it computes
        with self._summing(gouts, last=last, params=generic, after=after) as sums:
            if plan is not None and direct:
                adder = self._direct_adder(plan.work.direct, last)
                grads_in = backward_whole(plan, outs, gouts, inputs, generic, adder, retain=retain)
            else:
                result = engine.grad(outs, [*inputs, *self.params], gouts, retain_graph=retain)
                grads_in = list(result[: len(inputs)])
                sums.add(enumerate(result[len(inputs) :]))
        self._disown(sums.fresh, [g for g in grads_in if g is not None])
        return grads_in

    def _closing(self) -> bool:
        """Count a micro-batch's last backward action; True if it is the mini-batch's last."""
        self._closed += 1
        return self._closed == self.m

    def _recompute(self, rec: _Record, i: int) -> Value:
        start = time.perf_counter()
        with self._context(i, replay=True), recomputing(self.stage.layers), torch.enable_grad():
            y = self._run(rec.input, i)
        self._tell(i, "recompute", start)
        return y

    # -- W ------------------------------------------------------------------------------------
    def weight(self, i: int) -> None:
        """Compute micro-batch ``i``'s deferred parameter gradients (no-op if B did them)."""
        self._action_starts("W", i)
        work = self._weights.pop(i, None)
        if work is None:  # B did it all, and counted it
            return
        start = time.perf_counter()
        last = self._closing()
        with self._backward_context():
            if isinstance(work, _Later):
                self._whole(work.outputs, work.grads, [], last=last, known=work.known)
            else:
                self._weigh(work, last=last)
        self._done(i)
        self._tell(i, "weight", start)

    def _finished(self, i: int) -> None:
        """Micro-batch ``i``'s last backward action on this stage has run (B, or W where B
        left work): let go of what the step still references of its graph, so that what the
        graph saved is freed now rather than at the mini-batch's end. The chain's records are
        popped by B already; a model's stage lets go of its crossings."""

    def _weigh(self, work: WeightWork, *, last: bool) -> None:
        """W of a split backward: autograd again from the junctions for generic parameters,
        then the direct terms."""
        if work.generic():
            shared = [g for gs in work.grads.values() for g in gs if g is not None]
            shared += [g for _, g in work.roots]
            params = work.generic_params()
            with self._summing(shared, last=last, params=params, after=True) as sums:
                index = self._index
                sums.add((index[id(p)], g) for p, g in work.run())
            self._disown(sums.fresh, [])
        work.run_direct(self._direct_adder(work.direct, last))

    # -- gradient sums ------------------------------------------------------------------------
    def param_grads(self) -> list[Tensor | None]:
        """Per-parameter gradient sums over the micro-batches, in ``stage.trainable()`` order."""
        return list(self._sums)

    def release(self) -> None:
        """Forget the sums and anything kept of the mini-batch (its owner holds them now; a
        sum referenced once can become ``.grad`` without a copy)."""
        self._sums = [None] * len(self.params)
        self._records.clear()
        self._weights.clear()
        self._closed = 0
        if self.offload is not None:
            self.offload.clear()

    def _summing(
        self, shared: Sequence[Tensor], *, last: bool, params: Sequence[Tensor], after: bool
    ) -> _Sums:
        """Add each gradient of ``params`` (those the pass computes) into its sum, and on the
        ``last`` pass hand each final sum to :attr:`on_final`. Returns a :class:`_Sums` (a
        context: any hooks go at its end) whose ``fresh`` lists the indices of the sums that
        took a gradient of this pass as their buffer.

        ``after``: the pass returns every gradient it computes, and the caller hands them to
        :meth:`_Sums.add` (in any order: each parameter's sum takes its micro-batches in the
        same order either way). A small stage then sums them after the pass; hooks on the
        parameters instead (removed afterwards) sum each one as soon as autograd computes it,
        while it is still in cache, where the sums are larger than a cache, and on a last
        pass with :attr:`on_final` (a final sum handed over while the pass still runs), or
        where the caller cannot see the gradients (``after=False``). Registering and
        removing a hook per parameter and pass is Python of the order of the arithmetic of
        a small stage's whole backward."""
        final = self.on_final if last else None
        sums = _Sums(self, shared, final)
        if after and final is None and self._small:
            return sums
        index = self._index
        sums.handles = [p.register_hook(self._adder(index[id(p)], sums)) for p in params]
        sums.hooked = True
        return sums

    def _adder(self, k: int, sums: _Sums) -> Callable[[Tensor], None]:
        def add(g: Tensor) -> None:
            self._add(k, g, sums)

        return add

    def _add(self, k: int, g: Tensor, sums: _Sums) -> None:
        """Add ``g``, a gradient of parameter ``k`` computed by the pass of ``sums``, into
        the parameter's sum (see :meth:`_summing`)."""
        total = self._sums[k]
        if total is None:
            # A fresh, dense gradient that nothing else of this pass uses is summed into in
            # place later on (no new buffer per micro-batch); one that shares its storage
            # is replaced by a new sum, never written to.
            self._sums[k] = g
            self._owned[k] = g.untyped_storage().data_ptr() not in sums.keep and _whole(g)
            sums.fresh.append(k)
        elif self._owned[k]:
            total.add_(g)
        else:
            self._sums[k], self._owned[k] = total + g, True
        final = sums.final
        if final is not None:
            done = self._sums[k]
            # A buffer taken in this very pass may alias another gradient of it: copy.
            final(k, done.clone() if k in sums.fresh else done)  # type: ignore[union-attr, arg-type]
            self._sums[k] = None

    def _direct_adder(self, terms: Sequence[Direct], last: bool) -> Adder:
        """Sum direct terms (:mod:`pipepar.core.split_backward`) into the sums, the product
        adding into an owned sum itself; on the ``last`` pass hand each parameter's sum to
        :attr:`on_final` after its last term (a parameter may have several: a weight used
        twice)."""
        final = self.on_final if last else None
        # Terms left per parameter: counted only where a final sum is handed over.
        left = Counter(self._index[id(t.param)] for t in terms) if final is not None else None

        def add(term: Direct, grad: Tensor | None) -> None:
            k = self._index[id(term.param)]
            if grad is not None:
                self._sums[k] = term.add(grad, self._sums[k], self._owned[k])
                self._owned[k] = True  # a new product, or the owned sum it was added into
            if left is None or final is None:
                return
            left[k] -= 1
            done = self._sums[k]
            if left[k] == 0 and done is not None:
                final(k, done)
                self._sums[k] = None

        return add

    def _disown(self, fresh: list[int], others: Sequence[Tensor]) -> None:
        """Never write into a new sum whose storage another gradient of the pass shares (two
        parameters' gradients as views of one tensor, or a parameter's and an input's)."""
        kept = [k for k in fresh if self._sums[k] is not None]
        if not kept:  # every sum of the pass was one of an earlier pass: none is new
            return
        ptrs = Counter(self._sums[k].untyped_storage().data_ptr() for k in kept)  # type: ignore[union-attr]
        ptrs.update(t.untyped_storage().data_ptr() for t in others)
        for k in kept:
            if ptrs[self._sums[k].untyped_storage().data_ptr()] > 1:  # type: ignore[union-attr]
                self._owned[k] = False

    def _backward_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a backward action runs in: the stage's device, autocast off (see
        :meth:`Autocast.__call__`); nothing to enter on a CPU stage without autocast."""
        if not self._contexts:
            return _NOTHING
        stack = contextlib.ExitStack()
        if self.stage.device.type == "cuda":
            stack.enter_context(torch.cuda.device(self.stage.device))
        stack.enter_context(self.autocast(enabled=False))
        return stack

    def _tell(self, i: int, kind: str, start: float) -> None:
        if self.record is not None:
            self.record(self.stage.index, i, kind, start, time.perf_counter())


def check_output(stage: Stage, x: Value, y: Value) -> Value:
    """``y``, what ``stage`` returned for ``x``, if it keeps the rows of ``x`` on dimension 0
    (one shape comparison per stage output); else a ValueError naming the stage's last layer
    (:func:`~pipepar.core.microbatch.check_rows`)."""
    first = tensors(x)[0]
    if first.dim() > 0:
        check_rows(y, first.shape[0], lambda: _last_layer(stage))
    return y


def _last_layer(stage: Stage) -> str:
    """E.g. ``layer 4 'head' (Linear), the last of stage 1 (layers 3..4 on cpu),``."""
    index = stage.stop - 1
    name = stage.names[-1] if stage.names else str(index)
    named = "" if name == str(index) else f" {name!r}"
    kind = type(stage.layers[-1]).__name__
    return f"layer {index}{named} ({kind}), the last of {stage.describe()},"


def _leaf(value: Value, requires_grad: bool) -> Value:
    """``value`` detached, each floating tensor requiring a gradient if ``requires_grad``."""
    if isinstance(value, Tensor):
        return _leaf_tensor(value, requires_grad)
    return tuple(_leaf_tensor(t, requires_grad) for t in value)


def _leaf_tensor(t: Tensor, requires_grad: bool) -> Tensor:
    d = t.detach()
    return d.requires_grad_() if requires_grad and d.is_floating_point() else d


_STRIDED = torch.strided
_NOTHING: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()


def _whole(g: Tensor) -> bool:
    """True if ``g`` is dense, contiguous and spans its whole storage (a weight gradient is
    often a transposed view of a fresh product that covers all of it)."""
    return (
        g.layout == torch.strided
        and g.is_contiguous()
        and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    )
