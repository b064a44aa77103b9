"""F, B and W of one stage of a model cut while it runs (:mod:`pipepar.program.cut`).

:class:`SegmentStep` is a :class:`~pipepar.core.step.StageStep` whose forward is a stretch of
the model's own forward code (run by the micro-batch's :class:`~pipepar.program.driver.Driver`)
rather than a call of its layers, and whose inputs and outputs are the values the cut found
crossing into and out of the stage. Backward and the deferred weight gradients are the step's
own: the same gradient sums, B/W split and hand-off of final sums as for ``nn.Sequential``
stages. A stage that recomputes a micro-batch runs its units checkpointed
(:mod:`pipepar.program.recompute`): inside its backward, or, where the schedule lists an ``R``
for it, in that ``R`` (:mod:`pipepar.program.unit_calls`); a rebuilt micro-batch's backward
then reads what the recompute saved, and may split into B and W.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from pipepar.core.losses import kept_loss
from pipepar.core.recompute import should_checkpoint
from pipepar.core.split_backward import NextNodes
from pipepar.core.step import Grads, StageStep
from pipepar.program.cut import Crossing, Cut, Ledger
from pipepar.program.driver import Driver
from pipepar.program.recompute import recomputing_units
from pipepar.program.unit_calls import UnitCalls
from pipepar.program.weight_copies import SharedCopies

__all__ = ["Batch", "SegmentContext", "SegmentStep"]

SegmentContext = Callable[[int, int], contextlib.AbstractContextManager[Any]]
"""``context(stage, i)``: what micro-batch ``i``'s driver enters while it computes ``stage``."""


class Batch:
    """The micro-batches of one mini-batch in flight: their drivers and ledgers.

    Args:
        calls: ``calls[i]()`` runs the model's forward on micro-batch ``i``.
        cuts: per micro-batch, the cut its forward runs under (holding its ledger).
        context: what the drivers enter while they compute a stage (the stage's step's
            :meth:`SegmentStep.segment_context`, or how a rank follows another's stage).
        head: applied to micro-batch ``i``'s output on the stage that finishes it (a loss);
            backward then starts from it, with gradient ``seeds[i]``.
        seeds: the micro-batches' shares of the loss, times a loss scaler's scale.
    """

    def __init__(
        self,
        calls: Sequence[Callable[[], Any]],
        cuts: Sequence[Cut],
        context: SegmentContext,
        head: Callable[[Any, int], Tensor] | None = None,
        seeds: Sequence[float] | None = None,
    ) -> None:
        self.cuts = list(cuts)
        self.ledgers = [cut.ledger for cut in self.cuts]
        self.context = context
        self.head, self.seeds = head, seeds
        self.drivers = [
            Driver(self._call(i, call), self._stage_context(i)) for i, call in enumerate(calls)
        ]
        for driver, cut in zip(self.drivers, self.cuts):
            driver.follower = cut

    def _call(self, i: int, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            cut = self.cuts[i]
            with cut.running():
                out = call()
                cut.finish(out)
                if self.head is None:
                    return out
                loss = self.head(out, i)
            if loss.requires_grad:
                seed = self.seeds[i] if self.seeds is not None else 1.0
                cut.ledger.outputs.append((cut.stage, loss))
                start = torch.scalar_tensor(seed, dtype=loss.dtype, device=loss.device)
                cut.ledger.add_grad(loss, start)
            return kept_loss(loss)  # the ledger holds the graph's root, and lets go of it

        return run

    def _stage_context(self, i: int) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
        def enter(stage: int) -> contextlib.AbstractContextManager[Any]:
            self.cuts[i].stage = stage
            return self.context(stage, i)

        return enter

    def abort(self) -> None:
        for driver in self.drivers:
            driver.abort()

    def close(self) -> None:
        """Let go of the mini-batch once every forward has run and its results are read:
        the drivers, cuts and ledgers (which hold the micro-batches' graphs) and the context
        (the run's, which holds this batch), so that nothing of it waits for the cycle
        collector."""
        for ledger in self.ledgers:
            ledger.forget()
        self.drivers, self.cuts, self.ledgers = [], [], []
        self.context = _closed


def _closed(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
    raise RuntimeError("pipepar: the mini-batch is closed")


class SegmentStep(StageStep):
    """Stage ``stage.index``'s F, B and W over the micro-batches of ``batch``.

    Args:
        batch: the mini-batch's drivers and ledgers.
        params: the parameters this stage holds (tied ones once, on their first stage).
        aliases: ``(weight, alias)`` for each weight another stage holds that this one uses
            (:mod:`pipepar.program.aliases`): the alias takes a gradient as a held weight.
        rebuilds: ``rebuilds(i)`` is True where the schedule lists an ``R`` of micro-batch
            ``i`` on this stage (its units' recompute runs there, :meth:`rebuild`).
        **kwargs: as for :class:`~pipepar.core.step.StageStep`.
    """

    def __init__(
        self,
        stage: Any,
        m: int,
        *,
        batch: Batch,
        params: list[nn.Parameter],
        aliases: Sequence[tuple[nn.Parameter, Tensor]] = (),
        rebuilds: Callable[[int], bool] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(stage, m, **kwargs)
        self.batch = batch
        self._rebuilds = rebuilds or (lambda i: False)
        self._calls: dict[int, UnitCalls] = {}
        """By micro-batch: its checkpointed unit calls, where an ``R`` recomputes them."""
        self.held = params
        """The weights this stage holds that take a gradient (:meth:`param_grads`' order)."""
        self._aliased = [(p, leaf) for p, leaf in aliases if leaf.requires_grad]
        # The backward computes the aliases' gradients as the stage's own weights' (an alias
        # is a plain leaf tensor standing for a parameter).
        self.params = [*params, *(cast(nn.Parameter, leaf) for _, leaf in self._aliased)]
        self._index = {id(p): k for k, p in enumerate(self.params)}
        self._sums = [None] * len(self.params)
        self._owned = [False] * len(self.params)
        self._large = any(p.dim() == 2 and p.numel() >= 1 << 17 for p in self.params)
        self._per_call: dict[int, tuple[nn.Parameter, Tensor]] = {}
        """By weight ``id``: the gradient sum of a weight used through a leaf per micro-batch."""
        self._foreign: frozenset[int] = frozenset()
        """Stages computed by other ranks (whose values this one receives)."""
        self._copies = SharedCopies(self.params)
        self._shares_copies = bool(self.grad and self.autocast.states)
        """Whether the forwards' graphs save :attr:`_copies` (under autocast, training)."""
        # The graphs save the shared copies: a forward's own casts need not outlive their use.
        self._cast_cache = not self._shares_copies

    def segment_context(self, stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
        """What the driver enters while it computes this stage of micro-batch ``i``."""
        ckpt = self._recomputes(i)
        stack = self._context(i, replay=ckpt)
        stack.enter_context(torch.set_grad_enabled(self.grad))
        # One weight copy for all micro-batches (under autocast); what else the stage saves
        # goes to host memory where the offload plan says so (one pair of hooks does both).
        first = self._copies.pack if self._shares_copies else None
        if self.offload is not None and self.grad and not ckpt:
            saving = self.offload.saving(self.stage.index, i, first)
            stack.enter_context(saving)
        elif first is not None:
            stack.enter_context(self._copies.saving())
        into = self._calls.setdefault(i, UnitCalls()) if ckpt and self._rebuilds(i) else None
        stack.enter_context(recomputing_units(ckpt, into))
        return stack

    def _recomputes(self, i: int) -> bool:
        """Whether micro-batch ``i``'s units run checkpointed on this stage."""
        return self.grad and self.training and should_checkpoint(self.checkpoint, i, self.m)

    def _saved_readable(self, i: int) -> bool:
        calls = self._calls.get(i)
        return not self._recomputes(i) or (calls is not None and calls.rebuilt)

    # -- R ------------------------------------------------------------------------------------
    def rebuild(self, i: int) -> None:
        """Recompute micro-batch ``i``'s checkpointed unit calls on this stage (a listed
        ``R``): its backward then reads what they save, as it would have kept it."""
        calls = self._calls.get(i)
        if calls is None or calls.rebuilt:
            return
        start = time.perf_counter()
        self._action_starts("R", i)
        cuda = self.stage.device.type == "cuda"
        with torch.cuda.device(self.stage.device) if cuda else contextlib.nullcontext():
            calls.recompute()
        self._tell(i, "recompute", start)

    def _walked(self, i: int) -> NextNodes | None:
        return self.batch.ledgers[i].take_walked(self.stage.index)

    # -- F ------------------------------------------------------------------------------------
    def forward(self, i: int, x: Any) -> tuple[()]:
        start = time.perf_counter()
        self._action_starts("F", i)
        self.batch.drivers[i].advance(self.stage.index)
        self._tell(i, "forward", start)
        return ()

    # -- B ------------------------------------------------------------------------------------
    def backward(self, i: int, grads: Grads) -> tuple[()]:
        start = time.perf_counter()
        self._action_starts("B", i)
        ledger = self.batch.ledgers[i]
        pairs = ledger.leaving(self.stage.index)
        entering = ledger.entering(self.stage.index)
        if pairs:
            leaves = [c.leaf for c in entering]
            grads_in = self._backward(i, pairs, leaves)
            self._deliver(ledger, entering, grads_in)
        else:
            ledger.take_walked(self.stage.index)  # nothing to plan: let go of it now
            if self.grad:
                self._closing()
        self._backward_ran(i)
        self._tell(i, "backward", start)
        return ()

    def _finished(self, i: int) -> None:
        # What the stage made (its outputs, the loss) holds the stage's graph; the model's
        # forward has returned, and every stage it fed has run its B.
        self.batch.ledgers[i].release(self.stage.index, received=self._foreign)
        self._calls.pop(i, None)

    def _deliver(
        self, ledger: Ledger, entering: list[Crossing], grads: Sequence[Tensor | None]
    ) -> None:
        for crossing, g in zip(entering, grads):
            if g is None:
                continue
            if crossing.is_param:
                self._add_tied(crossing.original, g)  # type: ignore[arg-type]
            else:
                ledger.add_grad(crossing.original, g)

    def _add_tied(self, param: nn.Parameter, g: Tensor) -> None:
        """Sum the gradient of a weight used through a leaf of one micro-batch (one without
        an alias, :mod:`pipepar.program.aliases`) as it comes: one sum per weight, not one
        gradient per micro-batch kept to the step's end."""
        found = self._per_call.get(id(param))
        self._per_call[id(param)] = (param, g if found is None else found[1] + g)

    @property
    def tied(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Per weight another stage holds and this one uses, its gradient summed over the
        micro-batches (the runtime adds it to the holder's)."""
        sums = self._sums[len(self.held) :]
        found = [(p, g) for (p, _), g in zip(self._aliased, sums) if g is not None]
        return found + list(self._per_call.values())  # type: ignore[misc]

    def param_grads(self) -> list[Tensor | None]:
        """The held weights' gradient sums, in :attr:`held`'s order."""
        return list(self._sums[: len(self.held)])

    def release(self) -> None:
        super().release()
        self._sums = [None] * len(self.params)
        self._per_call = {}
        self._calls.clear()
        self._copies.clear()
