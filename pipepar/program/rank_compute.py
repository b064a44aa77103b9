"""How a rank runs its stages of any model: the model's own ``forward`` on every rank, the
rank's stages for real and the others in shadow or skipped (:class:`RankProgram`).

A rank computes one stage, or several under the virtual-stage schedules (``"interleaved-1f1b"``,
``"zb-v"``: ``schedule.stages_of(position)``), each stage's actions in the schedule's order.
See :mod:`pipepar.program.ranks` for how a rank follows the stages it does not compute.

The rank keeps only the weights its stages use (a weight tied across stages on every rank that
uses it). With ``dp_shard=True`` each weight a rank holds is sharded over the ``dp`` ranks of
its position (:meth:`pipepar.ranks.sharding.ShardedSync.of_parameters`): the model keeps its
parameter objects, so every table keyed by them (holders, tied groups, the cut's stand-ins,
routes) stays valid; they hold the gathered weights for a step only, and the pipe's
``parameters()`` are the shards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from pipepar.batching.calls import Call, StepCall, parts_of, split_call
from pipepar.batching.rules import Rules
from pipepar.core.batchnorm import committing, defer_statistics
from pipepar.core.executor import walk
from pipepar.core.losses import joined_loss
from pipepar.core.offload_plan import offloader_for
from pipepar.core.parameter_hooks import after_accumulation, hooks_set_aside, through_hooks
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.meta.shapes import MetaShapes
from pipepar.meta.values import KnownValues, MetaScalars, forget_dead
from pipepar.program import early_weights
from pipepar.program import units as units_
from pipepar.program.aliases import alias_leaves, of_stage, used_elsewhere
from pipepar.program.autograd import joined
from pipepar.program.cut import row_ledgers
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
from pipepar.program.rank_carrier import ProgramCarrier
from pipepar.program.rank_messages import RankMessages
from pipepar.program.rank_weights import holders, keep_only, tied_groups, weight_stages
from pipepar.program.ranks import RankCut, RankStep, WeightStages, shadow_context
from pipepar.program.recompute import checkpoint_units
from pipepar.program.route import Routes, signature
from pipepar.program.shadow import skip_elsewhere
from pipepar.program.step import Batch
from pipepar.ranks.measured_placement import MeasuredPlacement
from pipepar.ranks.pipe_context import PipeContext
from pipepar.ranks.replicas import broadcast_from_first, spread_over_replicas
from pipepar.ranks.sharding import ShardedSync, shard_like

__all__ = ["RankProgram"]

T = TypeVar("T")


class RankProgram:
    """Any model split into stages by ``balance`` (units per stage) or ``split`` (module paths
    where a stage begins) over the ranks."""

    default_checkpoint = "never"  # the model's units recompute one by one when asked

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None,
        *,
        split: Sequence[str] | None,
        deferred_batch_norm: bool,
        batch_coupling: str = "error",
        rules: Rules | None = None,
        order: Sequence[str] | None = None,
    ) -> None:
        defer_statistics(model, deferred_batch_norm)
        self.rules = rules or Rules()
        """How a call is cut into micro-batches and its output joined (said in wrap)."""
        self._forms = Forms(model, batch_coupling, deferred_batch_norm)  # outputs, by kind
        self.model = model
        self._order = order
        """The units' paths in call order (:func:`pipepar.program.units.model_units`), or
        None for the order the model registers them in."""
        self.sizes = units_.sizes_of(units_.model_units(model, order), balance, split)
        self.stage_of_unit = units_.stage_of_units(self.sizes)
        """Each unit's stage, in the model's unit order."""
        self._drivers: ThreadPoolExecutor | None = None
        self._sync: ShardedSync | None = None
        self._shapes = MetaShapes()
        self._known: KnownValues = {}  # meta values the shadows know, kept while they live
        """What the other stages' operations made on meta, kept from micro-batch to
        micro-batch (their meta kernels run once per shape)."""
        self.weights_run_early = 0
        """W actions run early while a B waited (:mod:`pipepar.program.early_weights`)."""

    def build(
        self, ctx: PipeContext, state_dict: Mapping[str, Tensor] | None, routes: bool
    ) -> None:
        """Keep the weights of the rank's stages (the others' stay on ``meta``), make the
        model's children the pipe's, and watch its units; replicas start from replica 0's
        weights unless ``state_dict`` is given. ``routes``: follow learned crossings."""
        self._ctx = ctx
        model, mesh, schedule, pipe = self.model, ctx.mesh, ctx.schedule, ctx.module
        self._mine = mine = schedule.stages_of(mesh.stage)
        lay = units_.model_units(model, self._order)
        held = [p for p, _ in holders(lay, self.stage_of_unit, mine)]
        self._held = keep_only(model, held, ctx.device, state_dict)
        lay = units_.model_units(model, self._order)  # the same units, the new parameters
        # The own stage holding each of this rank's weights (the others are on meta).
        self._owner = {id(p): s for p, s in holders(lay, self.stage_of_unit, mine)}
        for name, child in model.named_children():
            ctx.adopt(name, child)
        for name, p in model.named_parameters(recurse=False):
            pipe.register_parameter(name, p)
        self._uses = used_elsewhere(lay, self.stage_of_unit, self._owner, mine)
        self._hooks = watch_units(lay.units, self.stage_of_unit)
        skip_elsewhere(lay.units, self.stage_of_unit, mine)
        if ctx.checkpoint != "never":
            own = zip(lay.units, self.stage_of_unit)
            checkpoint_units([u.module for u, s in own if s in mine and u.has_parameters])
        # Where values cross, by kind of call (None: every call under the cut's mode).
        self._routes = Routes() if routes else None
        ranks = [mesh.pipeline_ranks[w] for w in schedule.placement]
        self._tied = tied_groups(lay, self.stage_of_unit, ranks)
        self._weights = WeightStages(*weight_stages(lay, self.stage_of_unit), rank_of=ranks)
        self._stages = [_stage(lay, self.stage_of_unit, s, ctx.device) for s in mine]
        self._link = RankMessages(mesh, ctx.device, schedule.placement)
        self._placement = MeasuredPlacement(
            schedule, ctx.asked, ctx.recompute, ctx.checkpoint, mine, mesh, ctx.device
        )
        if state_dict is None:  # replicas start from replica 0's weights
            ctx.guard(lambda: broadcast_from_first([p.data for p in self._held], mesh))
        self._shards = list(self._held)
        """What ``parameters()`` gives: the held weights, or with ``dp_shard`` their shards."""
        if ctx.dp_shard:  # after the broadcast: each replica keeps its shard of the same weights
            self._sync = ShardedSync.of_parameters(self._named_held(), mesh, ctx.device)
            self._shards = list(self._sync.shards)
        self._shard_of = {id(p): s for p, s in zip(self._held, self._shards)}

    def _named_held(self) -> list[tuple[str, nn.Parameter]]:
        """The held weights with their first names in the model."""
        names: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return [(names[id(p)], p) for p in self._held]

    def _gathered(self) -> contextlib.AbstractContextManager[Any]:
        """The held weights whole for one step's actions (gathered from their shards)."""
        return self._sync.gathered() if self._sync is not None else contextlib.nullcontext()

    # -- what this rank holds -------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Any:
        """This rank's weights (each once; with ``dp_shard``, their ``DTensor`` shards)."""
        return iter(self._shards)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's weights under their names (with ``dp_shard``, their shards)."""
        mine = self._shard_of
        named = nn.Module.named_parameters(self._ctx.module, *args, **kwargs)
        return ((n, mine[id(p)]) for n, p in named if id(p) in mine)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's entries under the model's keys (with ``dp_shard``, the shards): the
        weights it holds and every buffer, the model's own included (the other stages'
        buffers as this rank last saw them: :meth:`own_state` drops those)."""
        model = self.model  # the pipe's children and weights, and the model's own buffers
        full = nn.Module.state_dict(model, *args, **kwargs)
        if self._sync is not None:
            prefix, keep = kwargs.get("prefix", ""), kwargs.get("keep_vars", False)
            for name, p in nn.Module.named_parameters(model, remove_duplicate=False):
                shard = self._shard_of.get(id(p))
                if shard is not None and prefix + name in full:
                    full[prefix + name] = shard if keep else shard.detach()
        return {k: v for k, v in full.items() if not v.is_meta}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
        """Load the whole model's state_dict (its entries for other stages are ignored, as
        ``nn.Module`` loads into weights on ``meta``); with ``dp_shard``, each replica keeps
        its shard of the weights it holds (``assign`` does not apply to them)."""
        model = self.model
        if self._sync is None:
            return nn.Module.load_state_dict(model, state_dict, strict=strict, assign=assign)
        shards = {
            name: self._shard_of[id(p)]
            for name, p in nn.Module.named_parameters(model, remove_duplicate=False)
            if id(p) in self._shard_of
        }
        for name, value in state_dict.items():
            if name in shards:
                shards[name].detach().copy_(shard_like(value, shards[name]))
        rest = {k: v for k, v in state_dict.items() if k not in shards}
        result = nn.Module.load_state_dict(model, rest, strict=False, assign=assign)
        result.missing_keys[:] = [k for k in result.missing_keys if k not in shards]
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"load_state_dict: missing keys {result.missing_keys}, unexpected keys "
                f"{result.unexpected_keys}; pass the whole model's state_dict, or strict=False"
            )
        return result

    def own_state(self, state: Mapping[str, T]) -> dict[str, T]:
        """Of this rank's entries (``state_dict()``'s keys), those its stages are the source of
        (:func:`pipepar.program.units.state_owners`): what every gather of the whole model
        takes from this rank, each entry from one stage only, buffers from the stage that
        updates them and a tied weight from the first stage using it."""
        owner = units_.state_owners(self.model, self.stage_of_unit, self._order)
        return {k: v for k, v in state.items() if owner.get(k, self._mine[0]) in self._mine}

    def in_model_order(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A whole model's entries in the plain model's order."""
        order = {k: i for i, k in enumerate(self.model.state_dict(keep_vars=True))}
        return dict(sorted(state.items(), key=lambda kv: order.get(kv[0], len(order))))

    def clipped(self) -> tuple[list[Tensor], list[Tensor]]:
        """The weights whose gradients the rank counts in the norm (a weight tied across
        stages only on the rank of its first stage), and those it clips (all it holds)."""
        elsewhere = {id(q) for first, _, ps in self._tied if first not in self._mine for q in ps}
        owned: list[Tensor] = [self._shard_of[id(q)] for q in self._held if id(q) not in elsewhere]
        return owned, list(self._shards)

    # -- running --------------------------------------------------------------------------------
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forwards of a mini-batch under no_grad: what the model returns, joined, on the
        last stage's ranks; None on the others."""
        ctx = self._ctx
        calls = split_call(args, kwargs, ctx.chunks, self.rules, self.model)
        shares = ModelLoss(self.model, calls, self._forms, loss=False)
        batch, _ = ctx.guard(lambda: self._gathered_walk(calls, shares))
        try:
            if ctx.schedule.n_stages - 1 not in self._mine:
                return None
            return joined([d.result for d in batch.drivers], parts_of(calls), shares)
        finally:
            batch.close()

    def step(self, call: StepCall) -> float:
        """One mini-batch forward and backward (or, under no_grad, its forwards only); the
        loss over the replicas, on every rank (see
        :meth:`pipepar.distributed.pipe.DistributedPipe.step`)."""

        def run() -> float:
            self._ctx.mesh.progress.begin("start of the mini-batch")
            return self._step(call)

        return self._ctx.guard(run)

    def _step(self, call: StepCall) -> float:
        ctx = self._ctx
        calls, targets = call.microbatches(ctx.chunks, self.rules, self.model)
        if calls[0].rows == 0:
            raise ValueError(
                "the batch has no rows: pass at least one sample on dimension 0 of the tensors "
                "of pipe.step(...) (every rank of the pipeline gets the same batch)"
            )
        schedule = self._placement.placed(len(calls))  # fewer rows: fewer micro-batches
        shares = step_shares(call.loss_fn, self.model, calls, targets, call.items, self._forms)
        if ctx.schedule.n_stages - 1 in self._mine:  # where the shares seed the backward
            shares = spread_over_replicas(shares, mesh=ctx.mesh, device=ctx.device)
        shares = shares.scaled(call.scale)
        grad = torch.is_grad_enabled()
        with self._gathered():  # sharded: gathered once for every action of the step
            head = loss_head(shares, targets, call.loss_fn)
            with hooks_set_aside(self._held) if grad else contextlib.nullcontext():
                batch, steps = self._walk(calls, schedule, shares, head, grad=grad)
            if grad:
                self._write_grads(steps)
        self._placement.ran(grad)  # after the timed step: placed again on the shared times
        ctx.schedule = self._placement.full
        try:
            return self._loss(batch, shares.weights)
        finally:
            batch.close()

    def _gathered_walk(
        self, calls: list[Call], shares: ModelLoss | None
    ) -> tuple[Batch, list[RankStep]]:
        schedule = self._placement.placed(len(calls))
        with self._gathered():
            return self._walk(calls, schedule, shares, None, grad=False)

    def _walk(
        self,
        calls: list[Call],
        schedule: Schedule,
        shares: Shares | None,
        head: Callable[[Any, int], Tensor] | None,
        *,
        grad: bool,
    ) -> tuple[Batch, list[RankStep]]:
        """Run this rank's actions of ``schedule`` on the micro-batch ``calls``: the own
        stages' for real, the others in shadow; without ``grad`` the forward ones only, and
        nothing is kept for a backward."""
        seeds = shares.seeds if shares is not None else None
        flags = (self.model.training, grad, head is not None, isinstance(shares, ModelLoss))
        aliases = alias_leaves(self._uses, [self._ctx.device] * self._ctx.schedule.n_stages)
        forget_dead(self._known)
        cuts = [
            RankCut(
                ledger,
                self._owner,
                [self._ctx.device] * self._ctx.schedule.n_stages,
                {},
                mine=self._mine,
                link=self._link,
                values=MetaScalars(self._shapes, self._known),
                routes=self._routes,
                key=signature(c.args, c.kwargs, *flags),
                aliases=aliases,
                model=self.model,
                weights=self._weights,
            )
            for c, ledger in zip(calls, row_ledgers(calls))
        ]
        shadow = shadow_context(cuts, grad)

        def context(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
            # ``steps`` are made below, before any driver runs.
            own = steps.get(stage)
            return own.segment_context(stage, i) if own is not None else shadow(stage, i)

        watch = watcher(shares, self.model, calls, self._forms)
        if watch is not None and cuts:
            watch.resolve = cuts[0].original_of
        batch = Batch(callers(self.model, calls, watch), cuts, context, head=head, seeds=seeds)
        offloader = offloader_for(
            self._ctx.offload and grad and self.model.training, schedule, self._stages
        )
        steps = {
            stage.index: RankStep(
                stage,
                len(calls),
                batch=batch,
                params=self._trained(stage.index),
                aliases=of_stage(self._uses, aliases, stage.index),
                checkpoint=self._ctx.checkpoint,
                offload=offloader,
                grad=grad,
                input_grad=True,
                streams=None,  # one driver computes at a time: draws in order
                split=functools.partial(schedule.splits_backward, stage.index),
                rebuilds=functools.partial(schedule.rebuilds, stage.index),
                cuts=cuts,
                link=self._link,
                mine=self._mine,
                record=self._placement.recorder(grad),
            )
            for stage in self._stages
        }
        own = [layer for stage in self._stages for layer in stage.layers]
        with committing(own, dropping=[self.model]):  # other ranks' as they were
            self._run(batch, steps, schedule, grad)
        return batch, list(steps.values())

    def _run(
        self, batch: Batch, steps: Mapping[int, RankStep], schedule: Schedule, grad: bool
    ) -> None:
        """This rank's actions in the schedule's order (the forward ones only without
        ``grad``: each waits only on forwards, so they keep their order)."""
        progress = self._ctx.mesh.progress
        pool = self._driver_threads(len(batch.drivers))
        for driver in batch.drivers:
            pool.submit(driver.run)
        actions = [a for a in schedule.worker(self._ctx.mesh.stage) if grad or a.kind == "F"]
        self._link.early = grad and schedule.in_order()
        first = min(self._mine)
        early_ok = self._link.early and early_weights.enabled()
        order = early_weights.EarlyWeights(actions) if early_ok else None
        carrier = ProgramCarrier(batch, steps, progress, _ahead(actions, first), first, order)
        try:
            walk(actions, steps, carrier)
        finally:
            self.weights_run_early += order.count if order is not None else 0
        progress.begin("end of the mini-batch")
        self._link.flush()

    def _trained(self, s: int) -> list[nn.Parameter]:
        """The weights own stage ``s`` holds that take a gradient."""
        return [p for p in self._held if self._owner[id(p)] == s and p.requires_grad]

    def _write_grads(self, steps: Sequence[RankStep]) -> None:
        """Add this step's gradients into ``.grad``: each tied weight's summed over the stages
        that use it (on this rank, then over the ranks), all averaged over the replicas. Only
        the step's own gradients are reduced (``.grad`` may hold earlier steps' already:
        accumulation); a frozen weight gets none."""
        mesh = self._ctx.mesh
        fresh: dict[int, Tensor | None] = {}
        for step in steps:
            fresh.update((id(p), g) for p, g in zip(step.held, step.param_grads()))
        for step in steps:  # the aliases' gradients, added to their holder's
            for p, part in step.tied:
                total = fresh.get(id(p))
                fresh[id(p)] = part if total is None else total + part
            step.release()
        for _, group, params in self._tied:
            for p in params:
                if p.requires_grad:  # every user holds it, frozen or not, on every rank alike
                    g = fresh.get(id(p))
                    fresh[id(p)] = g = g if g is not None else torch.zeros_like(p)
                    mesh.progress.all_reduce(g, group, "the sum of tied weights")
        for p in self._held:  # each once, on its whole gradient (before the replicas')
            g = fresh.get(id(p))
            if g is not None and p.requires_grad and p._backward_hooks:
                fresh[id(p)] = through_hooks(p, g)
        if self._sync is not None:
            self._scatter(fresh)
            return
        if mesh.dp_group is not None:
            for p in self._held:
                g = fresh.get(id(p))
                if p.requires_grad and g is not None:
                    mesh.progress.all_reduce(g, mesh.dp_group, "the gradient all-reduce")
                    g /= self._ctx.dp
        for p in self._held:
            g = fresh.get(id(p))
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
                after_accumulation(p)

    def _scatter(self, fresh: Mapping[int, Tensor | None]) -> None:
        """Reduce-scatter this step's gradients over the replicas into the shards' ``.grad``
        (added to it), bucket by bucket (:class:`~pipepar.ranks.sharding.ShardedSync`)."""
        assert self._sync is not None
        self._sync.arm()
        for p in self._held:
            g = fresh.get(id(p))
            if g is not None and p.requires_grad:
                p.grad = g  # the gathered weight's: taken (and dropped) by the scatter
        self._sync.ready(self._held, overlapped=False)
        self._sync.finish()

    def _loss(self, batch: Batch, weights: Sequence[float]) -> float:
        mesh = self._ctx.mesh
        last = self._ctx.schedule.n_stages - 1
        # float64 on every rank: it carries a float64 loss whole, a float32 one exactly.
        value = torch.zeros(1, dtype=torch.float64, device=self._ctx.device)
        if last in self._mine:
            value += joined_loss([d.result for d in batch.drivers], weights)
        if mesh.ctl is not None:
            mesh.progress.all_reduce(value, mesh.ctl, "sharing the loss")
        if mesh.dp_group is not None:
            mesh.progress.all_reduce(value, mesh.dp_group, "averaging the loss")
            value /= self._ctx.dp
        return float(value.item())

    def _driver_threads(self, m: int) -> ThreadPoolExecutor:
        self._drivers = driver_pool(self._drivers, m, torch.get_num_threads(), self._ctx.device)
        return self._drivers

    def close(self) -> None:
        """Stop the driver threads; release the link's and the shards' groups."""
        if self._drivers is not None:
            self._drivers.shutdown(wait=False)
            self._drivers = None
        self._link.drop()
        if self._sync is not None:
            self._sync.drop()


def _stage(
    lay: units_.ModelUnits, stage_of_unit: Sequence[int], s: int, device: torch.device
) -> Stage:
    """Stage ``s``: its units, named by their module paths."""
    units = list(units_.iter_stage_units(lay, stage_of_unit, s))
    start = sum(1 for t in stage_of_unit if t < s)
    names = [u.path.replace(".", "/") for u in units]
    return Stage(s, start, [u.module for u in units], device, names=names)


def _ahead(actions: Sequence[Any], first: int) -> dict[int, int]:
    """At which action (by position) to let which micro-batch's forward run on through the
    stages before ``first`` (the rank's first own stage): at the backward action before its
    ``F(first)``, so that the walk through others' code overlaps a backward."""
    out: dict[int, int] = {}
    if first == 0:
        return out
    last_backward = None
    for k, a in enumerate(actions):
        if a.kind != "F":
            last_backward = k
        elif a.stage == first and last_backward is not None and last_backward not in out:
            out[last_backward] = a.microbatch
    return out
