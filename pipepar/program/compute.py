"""How a pipe runs any model: its own ``forward``, cut into stages while it runs
(:class:`ProgramCompute`).

The model keeps its own code, submodules and names: its units (:mod:`pipepar.program.units`)
are placed on their stage's device, and each micro-batch's forward runs the model's own
``forward``, cut into stages while it runs (:mod:`pipepar.program.cut`), in the schedule's
order (:mod:`pipepar.program.driver`). Values crossing a boundary travel by themselves; a
weight used by two stages (tied embedding and head) is held by the first and its gradients
from both are summed there. After the first call of a kind, calls follow the crossings
learned then (:mod:`pipepar.program.route`), without per-operation interception.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.batching.calls import Call, StepCall, parts_of, split_call
from pipepar.batching.rules import Rules
from pipepar.core.batchnorm import committing, defer_statistics, reset_all
from pipepar.core.losses import LossNotJoinable, joined_loss, kept_loss
from pipepar.core.reductions import BatchCoupled
from pipepar.core.stage import Stage
from pipepar.local import cpu_malloc
from pipepar.local.autograd import StepFunction
from pipepar.local.chain import runs_directly
from pipepar.local.executor import EVERY, FORWARD
from pipepar.local.pipe_view import PipeView
from pipepar.program import units as units_
from pipepar.program.aliases import alias_leaves, of_stage, used_elsewhere
from pipepar.program.autograd import ProgramFunction, as_tuple, joined
from pipepar.program.cut import Cut, row_ledgers
from pipepar.program.driver import driver_pool, watch_units
from pipepar.program.losses import (
    Forms,
    ModelLoss,
    Shares,
    callers,
    loss_head,
    step_shares,
    watcher,
)
from pipepar.program.recompute import checkpoint_units
from pipepar.program.rerun import Rerun
from pipepar.program.route import PathChanged, Routes, signature
from pipepar.program.run import ProgramRun
from pipepar.program.step import Batch

__all__ = ["ProgramCompute", "ProgramStage"]

T = TypeVar("T")


class ProgramStage(Stage):
    """A stage of a model cut while it runs: its units, named by their module paths."""

    def describe(self) -> str:
        names = self.paths
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        return f"stage {self.index} ({span} on {self.device})"

    @property
    def paths(self) -> list[str]:
        return [n.replace("/", ".") for n in self.names or []]


class ProgramCompute:
    """Any model split into stages by ``balance`` (units per stage) or ``split`` (module paths
    where a stage begins); with ``sample``, units are ordered as the model calls them."""

    default_checkpoint = "never"  # the model's units recompute one by one when asked

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None,
        *,
        split: Sequence[str] | None,
        sample: Any,
        deferred_batch_norm: bool,
        batch_coupling: str = "error",
        rules: Rules | None = None,
    ) -> None:
        defer_statistics(model, deferred_batch_norm)
        self.rules = rules or Rules()
        """How a call is cut into micro-batches and its output joined (said in wrap)."""
        order = [u.path for u in units_.units(model, sample)] if sample is not None else None
        self._units = units_.model_units(model, order)
        self.sizes = units_.sizes_of(self._units, balance, split)
        self.model = model
        self.paths = [u.path for u in self._units.units]
        """Each unit's module path in the model."""
        self._stage_of_unit = units_.stage_of_units(self.sizes)
        self._owner = units_.owners(self._units, self._stage_of_unit)
        self._params: list[list[nn.Parameter]] = []
        self._routes = Routes()  # where values cross, by kind of call
        self._forms = Forms(model, batch_coupling, deferred_batch_norm)  # outputs, by kind
        self._drivers: ThreadPoolExecutor | None = None

    def place(self, devices: Sequence[torch.device], checkpoint: str) -> list[Stage]:
        """Move every weight to its holder's device and every unit's buffers to its stage's;
        the stages."""
        lay, stage_of_unit = self._units, self._stage_of_unit
        _place(self.model, lay, stage_of_unit, self._owner, devices)
        self._params = _held(self.model, self._owner, len(self.sizes))
        self._uses = used_elsewhere(lay, stage_of_unit, self._owner, range(len(self.sizes)))
        self._hooks = watch_units(lay.units, stage_of_unit)
        if checkpoint != "never":
            checkpoint_units([u.module for u in lay.units if u.has_parameters])
        self._rerun = Rerun(self.model, devices)  # what a call run again starts from
        return _stages(lay, stage_of_unit, devices)

    # -- pipe(...) ------------------------------------------------------------------------------
    def forward(self, pipe: PipeView, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the model on the batch, micro-batch by micro-batch through the stages; what the
        model returns, joined over the micro-batches."""
        calls = split_call(args, kwargs, pipe.chunks, self.rules, self.model)
        shares = ModelLoss(self.model, calls, self._forms, loss=False)
        if runs_directly(pipe, len(calls)):
            return self._retrying(lambda: self._forward_direct(pipe, calls, shares))
        return self._retrying(lambda: self._forward(pipe, calls, shares))

    def _forward_direct(self, pipe: PipeView, calls: list[Call], shares: ModelLoss | None) -> Any:
        """One stage, nothing to recompute: the model called on each micro-batch, on plain
        autograd."""
        results = [call() for call in callers(self.model, _on(calls, pipe.devices[0]), shares)]
        return joined(results, parts_of(calls), shares)

    def _forward(self, pipe: PipeView, calls: list[Call], shares: ModelLoss | None) -> Any:
        params = [p for held in self._trainable() for p in held]
        flat_in = [t for c in calls for t in c.tensors()]
        needs_grad = torch.is_grad_enabled() and (
            bool(params) or any(t.requires_grad for t in flat_in)
        )
        run = self._run(pipe, calls, grad=needs_grad, shares=shares)
        if not needs_grad:
            pipe.execute(run, FORWARD)
            return joined(run.results(), run.parts, shares)
        holder: dict[str, Any] = {}
        outs = ProgramFunction.apply(pipe, run, holder, shares, len(flat_in), *flat_in, *params)
        leaves = list(holder["leaves"])
        for k, t in zip(holder["positions"], as_tuple(outs)):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, holder["spec"])

    # -- pipe.step ------------------------------------------------------------------------------
    def step(self, pipe: PipeView, call: StepCall) -> Tensor:
        """Forward and backward of one mini-batch in the schedule's order; the joined loss
        (see :meth:`pipepar.pipe.Pipe.step`)."""
        calls, targets = call.microbatches(pipe.chunks, self.rules, self.model)
        shares = step_shares(call.loss_fn, self.model, calls, targets, call.items, self._forms)
        shares = shares.scaled(call.scale)
        attempt = self._step_direct if runs_directly(pipe, len(calls)) else self._step
        return self._retrying(lambda: attempt(pipe, calls, targets, shares, call.loss_fn))

    def _step_direct(
        self,
        pipe: PipeView,
        calls: list[Call],
        targets: Sequence[Any],
        shares: Shares,
        loss_fn: Any,
    ) -> Tensor:
        """One stage, nothing to recompute: each micro-batch's forward, then its loss's
        backward seeded with its share (times a loss scaler's scale), on plain autograd (draws
        and statistics in the order of the one-stage schedule's forwards)."""
        head = loss_head(shares, targets, loss_fn)
        grad = torch.is_grad_enabled()
        seeds = shares.seeds
        losses = []
        placed = _on(calls, pipe.devices[0])
        watch = watcher(shares, self.model, placed, self._forms)
        for i, call in enumerate(callers(self.model, placed, watch)):
            loss = head(call(), i)
            seed = seeds[i]  # known once micro-batch 0's loss is
            if grad and seed != 0 and loss.requires_grad:
                (loss * seed).backward()
            losses.append(kept_loss(loss))
        return joined_loss(losses, shares.weights)

    def _step(
        self,
        pipe: PipeView,
        calls: list[Call],
        targets: Sequence[Any],
        shares: Shares,
        loss_fn: Any,
    ) -> Tensor:
        grad = torch.is_grad_enabled()
        head = loss_head(shares, targets, loss_fn)
        params = [p for held in self._trainable() for p in held]  # read before _run uses them
        run = self._run(pipe, calls, grad=grad, head=head, shares=shares)
        if not grad:  # evaluation: the schedule's forward actions only, no graph kept
            pipe.execute(run, FORWARD)
            return joined_loss(run.results(), shares.weights)
        flat_in = [t for c in calls for t in c.tensors()]

        def step_all() -> Tensor:
            run.open_backward()
            pipe.execute(run, EVERY)
            return joined_loss(run.results(), shares.weights)

        loss = StepFunction.apply(step_all, run, *flat_in, *params)
        loss.backward()
        return loss.detach()

    def _trainable(self) -> list[list[nn.Parameter]]:
        """The weights each stage holds that take a gradient, read again at each call: a
        weight frozen or unfrozen after ``wrap`` (``requires_grad_``, as between phases of a
        fine-tuning) takes a gradient exactly when it would in the plain model."""
        self._params = _held(self.model, self._owner, len(self.sizes))
        return self._params

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """``attempt()``; if a micro-batch left the route it followed, again from the same
        random state and batch-norm statistics with that route forgotten (the call then runs
        under the cut's mode). Nothing was written to ``.grad`` before the forward ended. A
        first call refused (an operation mixing rows, a loss that cannot be joined) leaves the
        random state and statistics as they were too."""
        start = self._rerun.start()
        with committing([self.model]):  # deferred batch norms: the mini-batch's statistics
            try:
                return attempt()
            except PathChanged as changed:
                self._routes.distrust(changed.key)
                reset_all([self.model])
                start.restore()
                return attempt()
            except (BatchCoupled, LossNotJoinable):
                reset_all([self.model])
                start.restore()
                raise

    def _run(
        self,
        pipe: PipeView,
        calls: list[Call],
        *,
        grad: bool,
        head: Any = None,
        shares: Shares | None = None,
    ) -> ProgramRun:
        inputs = [c.tensors() for c in calls]
        context = (self.model.training, grad, head is not None, isinstance(shares, ModelLoss))
        aliases = alias_leaves(self._uses, pipe.devices)
        cuts = [
            Cut(
                ledger,
                self._owner,
                pipe.devices,
                {id(t): t for t in xs},
                self._routes,
                signature(c.args, c.kwargs, *context),
                aliases,
                self.model,
            )
            for c, xs, ledger in zip(calls, inputs, row_ledgers(calls))
        ]
        watch = watcher(shares, self.model, calls, self._forms)
        if watch is not None and cuts:
            watch.resolve = cuts[0].original_of
        batch = functools.partial(
            Batch,
            callers(self.model, calls, watch),
            cuts,
            head=head,
            seeds=shares.seeds if head is not None and shares is not None else None,
        )
        if any(d.type == "cpu" for d in pipe.devices) and grad:
            cpu_malloc.tune()
        return ProgramRun(
            pipe.stages,
            self._params,
            pipe.schedule(len(calls)),
            batch,
            self._driver_threads(pipe, len(calls)),
            inputs,
            parts_of(calls),
            grad=grad,
            tracer=pipe.tracer,
            draws=pipe.draws,
            checkpoint=pipe.checkpoint,
            offload=pipe.offload,
            timing=pipe.timing(),
            aliases=[of_stage(self._uses, aliases, s) for s in range(len(self.sizes))],
        )

    def _driver_threads(self, pipe: PipeView, m: int) -> ThreadPoolExecutor:
        self._drivers = driver_pool(self._drivers, m, min(pipe.threads), pipe.devices[0])
        return self._drivers

    def close(self) -> None:
        """Stop the driver threads."""
        if self._drivers is not None:
            self._drivers.shutdown(wait=False)
            self._drivers = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_drivers"] = None
        return state


def _on(calls: list[Call], device: torch.device) -> list[Call]:
    """The micro-batch calls with their tensors on ``device`` (the one stage's)."""

    def there(leaf: Any) -> Any:
        return leaf.to(device) if isinstance(leaf, Tensor) and leaf.device != device else leaf

    moved = [pytree.tree_map(there, (c.args, c.kwargs, c.absent)) for c in calls]
    return [
        replace(c, args=args, kwargs=kwargs, absent=absent)
        for (args, kwargs, absent), c in zip(moved, calls)
    ]


# -- building -------------------------------------------------------------------------------
def _place(
    model: nn.Module,
    lay: units_.ModelUnits,
    stage_of_unit: Sequence[int],
    owner: dict[int, int],
    devices: Sequence[torch.device],
) -> None:
    """Move each parameter to its holder's device, and each unit's buffers to its stage's."""
    for p in model.parameters():
        device = devices[owner.get(id(p), 0)]
        if p.device != device:
            p.data = p.data.to(device)
    for unit, s in zip(lay.units, stage_of_unit):
        for module in unit.module.modules():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.device != devices[s]:
                    module._buffers[name] = b.to(devices[s])


def _stages(
    lay: units_.ModelUnits, stage_of_unit: Sequence[int], devices: Sequence[torch.device]
) -> list[Stage]:
    stages: list[Stage] = []
    start = 0
    for s, device in enumerate(devices):
        mine = list(units_.iter_stage_units(lay, stage_of_unit, s))
        names = [u.path.replace(".", "/") or "model" for u in mine]
        stages.append(ProgramStage(s, start, [u.module for u in mine], device, names=names))
        start += len(mine)
    return stages


def _held(model: nn.Module, owner: dict[int, int], n: int) -> list[list[nn.Parameter]]:
    held: list[list[nn.Parameter]] = [[] for _ in range(n)]
    for p in model.parameters():  # each once, tied ones included once
        if p.requires_grad:
            held[owner.get(id(p), 0)].append(p)
    return held
