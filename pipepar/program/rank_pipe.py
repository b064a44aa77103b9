"""DistributedModelPipe: any model split over the ranks of a pipeline (``pipepar.distributed``).

A rank computes one stage, or several under the virtual-stage schedules (``"interleaved-1f1b"``,
``"zb-v"``: ``schedule.stages_of(position)``), each stage's actions in the schedule's order.
See :mod:`pipepar.program.ranks` for how a rank follows the stages it does not compute.

With ``dp_shard=True`` each weight a rank holds is sharded over the ``dp`` ranks of its
position (:meth:`pipepar.ranks.sharding.ShardedSync.of_parameters`): the model keeps its
parameter objects, so every table keyed by them (holders, tied groups, the cut's stand-ins,
routes) stays valid; they hold the gathered weights for a step only, and ``parameters()`` are
the shards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import committing, convert_inside
from pipepar.core.losses import Items, LossShares, joined_loss, split_target
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.program import units as units_
from pipepar.program.autograd import joined
from pipepar.program.calls import Call, split_call
from pipepar.program.cut import Ledger
from pipepar.program.driver import driver_pool, watch_units
from pipepar.program.losses import LossFn, ModelLoss, callers, loss_head, step_shares
from pipepar.program.meta_values import MetaScalars
from pipepar.program.rank_weights import holders, keep_only, tied_groups
from pipepar.program.ranks import Link, RankCut, RankStep, shadow_context, skip_elsewhere
from pipepar.program.recompute import checkpoint_units
from pipepar.program.route import Routes, signature
from pipepar.program.step import Batch
from pipepar.program.units import sizes_of as _sizes
from pipepar.ranks import clipping, handshake
from pipepar.ranks.arguments import check_schedule, check_timeout
from pipepar.ranks.guard import Guard
from pipepar.ranks.mesh import build_mesh, check_grid
from pipepar.ranks.process import ensure_process_group as _ensure_process_group
from pipepar.ranks.process import resolve_device as _resolve_device
from pipepar.ranks.progress import describe
from pipepar.ranks.replicas import broadcast_from_first, spread_over_replicas
from pipepar.ranks.runtime import fewer_microbatches
from pipepar.ranks.sharding import ShardedSync, check_dp_shard, shard_like

__all__ = ["DistributedModelPipe"]

F = TypeVar("F", bound=Callable[..., Any])


def _stepping(method: F) -> F:
    """``method``, a step, run by the pipe's guard: one rank's failure or stall ends every
    rank of the pipeline with one report."""

    @functools.wraps(method)
    def run(self: DistributedModelPipe, *args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            self.mesh.progress.begin("start of the mini-batch")
            return method(self, *args, **kwargs)

        return self._guarded(call)

    return run  # type: ignore[return-value]


class DistributedModelPipe(nn.Module):
    """This rank's stages of any model split over the ranks of a pipeline, with ``dp`` replicas.

    Build it with :func:`pipepar.distributed.wrap` on every rank, with the same arguments. The
    rank keeps only the weights its stages use (a weight tied across stages on every rank that
    uses it): build the model on the ``meta`` device and pass ``state_dict``, or build it real
    and the other stages' weights are dropped. ``parameters()`` and ``state_dict()`` cover the
    rank's own weights under the model's names. With ``dp_shard=True`` they are this
    replica's ``DTensor`` shards of them, and so are their gradients (see
    :mod:`pipepar.ranks.sharding`).
    """

    _model: nn.Module  # not a child: its children are the pipe's

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        *,
        split: Sequence[str] | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        dp: int = 1,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        timeout: float | None = 300.0,
        routes: bool = True,
        checkpoint: str = "never",
        deferred_batch_norm: bool = False,
        dp_shard: bool = False,
    ) -> None:
        super().__init__()
        try:
            self.chunks = validation.check_chunks(chunks)
            self.checkpoint = validation.check_checkpoint(checkpoint)
            timeout = check_timeout(timeout)
            if deferred_batch_norm:
                convert_inside(model)
            lay = units_.layout(model)
            sizes = _sizes(lay, balance, split)
            self.schedule = check_schedule(schedule, len(sizes), self.chunks)
            _ensure_process_group()
            pp = self.schedule.n_workers
            self.dp = check_grid(dist.get_world_size(group), pp, dp, n_stages=len(sizes))
            self.dp_shard = check_dp_shard(dp_shard, self.dp)
        except (ValueError, TypeError) as error:
            if dist.is_initialized():  # peers must not wait for this rank: tell them why
                handshake.refuse(error, group=group)
            raise
        fields = handshake.fingerprint(
            model,
            sizes,
            chunks=self.chunks,
            schedule=self.schedule,
            dp=self.dp,
            checkpoint=self.checkpoint,
            state_dict=state_dict,
        )
        extra = {"dp_shard": str(self.dp_shard), "routes": str(routes), "units": str(len(sizes))}
        handshake.agree(fields | extra, group=group, timeout=timeout)
        self.group = group
        """The parent group of the grid (``None``: the world)."""
        self.device = _resolve_device(device, group)
        self.mesh = build_mesh(
            pp,
            self.dp,
            group=group,
            timeout=None if timeout is None else timedelta(seconds=timeout),
            placement=self.schedule.placement,
        )
        self._mine = mine = self.schedule.stages_of(self.mesh.stage)
        self.stage_of_unit = [s for s, n in enumerate(sizes) for _ in range(n)]
        object.__setattr__(self, "_model", model)
        held = [p for p, _ in holders(lay, self.stage_of_unit, mine)]
        self._held = keep_only(model, held, self.device, state_dict)
        lay = self._units = units_.layout(model)  # the same units, with the new parameters
        # The own stage holding each of this rank's weights (the others are on meta).
        self._owner = {id(p): s for p, s in holders(lay, self.stage_of_unit, mine)}
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self._hooks = watch_units(lay.units, self.stage_of_unit)
        skip_elsewhere(lay.units, self.stage_of_unit, mine)
        if self.checkpoint != "never":
            own = zip(lay.units, self.stage_of_unit)
            checkpoint_units([u.module for u, s in own if s in mine and u.has_parameters])
        # Where values cross, by kind of call (None: every call under the cut's mode).
        self._routes = Routes() if routes else None
        ranks = [self.mesh.pipeline_ranks[w] for w in self.schedule.placement]
        self._tied = tied_groups(lay, self.stage_of_unit, ranks)
        self._stages = [_stage(lay, self.stage_of_unit, s, self.device) for s in mine]
        self._link = Link(self.mesh, self.device, self.schedule.placement)
        self._sync: ShardedSync | None = None
        self._guarded = Guard(self, self.mesh, self.close)
        self._drivers: ThreadPoolExecutor | None = None
        if state_dict is None:  # replicas start from replica 0's weights
            self._guarded(lambda: broadcast_from_first([p.data for p in self._held], self.mesh))
        self._shards = list(self._held)
        """What ``parameters()`` gives: the held weights, or with ``dp_shard`` their shards."""
        if self.dp_shard:  # after the broadcast: each replica keeps its shard of the same weights
            self._sync = ShardedSync.of_parameters(self._named_held(), self.mesh, self.device)
            self._shards = list(self._sync.shards)
        self._shard_of = {id(p): s for p, s in zip(self._held, self._shards)}
        self._held_of = {id(s): p for p, s in zip(self._held, self._shards)}

    def _named_held(self) -> list[tuple[str, nn.Parameter]]:
        """The held weights with their first names in the model."""
        names: dict[int, str] = {}
        for name, p in self._model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return [(names[id(p)], p) for p in self._held]

    def _gathered(self) -> contextlib.AbstractContextManager[Any]:
        """The held weights whole for one step's actions (gathered from their shards)."""
        return self._sync.gathered() if self._sync is not None else contextlib.nullcontext()

    # -- what this rank holds -------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        """This rank's weights (each once; with ``dp_shard``, their ``DTensor`` shards)."""
        return iter(self._shards)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        mine = self._shard_of
        named = super().named_parameters(*args, **kwargs)
        return ((n, mine[id(p)]) for n, p in named if id(p) in mine)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """This rank's entries under the model's keys (with ``dp_shard``, the shards)."""
        full = super().state_dict(*args, **kwargs)
        if self._sync is not None:
            prefix, keep = kwargs.get("prefix", ""), kwargs.get("keep_vars", False)
            for name, p in super().named_parameters(remove_duplicate=False):
                shard = self._shard_of.get(id(p))
                if shard is not None and prefix + name in full:
                    full[prefix + name] = shard if keep else shard.detach()
        return {k: v for k, v in full.items() if not v.is_meta}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the whole model's state_dict (its entries for other stages are ignored, as
        ``nn.Module`` loads into weights on ``meta``); with ``dp_shard``, each replica keeps
        its shard of the weights it holds (``assign`` does not apply to them)."""
        if self._sync is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        shards = {
            name: self._shard_of[id(p)]
            for name, p in super().named_parameters(remove_duplicate=False)
            if id(p) in self._shard_of
        }
        for name, value in state_dict.items():
            if name in shards:
                shards[name].detach().copy_(shard_like(value, shards[name]))
        rest = {k: v for k, v in state_dict.items() if k not in shards}
        result = super().load_state_dict(rest, strict=False, assign=assign)
        result.missing_keys[:] = [k for k in result.missing_keys if k not in shards]
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"load_state_dict: missing keys {result.missing_keys}, unexpected keys "
                f"{result.unexpected_keys}; pass the whole model's state_dict, or strict=False"
            )
        return result

    def _weight(self, t: Tensor) -> Tensor:
        """The model parameter whose shard is ``t`` (``t`` itself for anything else)."""
        return self._held_of.get(id(t), t)

    @property
    def stage_index(self) -> int:
        """This rank's position in the pipeline, 0 to ``pp - 1`` (the schedule's worker
        index): its stage, or under the virtual-stage schedules the first of :attr:`stages`."""
        return self.mesh.stage

    @property
    def stages(self) -> list[int]:
        """The stages this rank computes (one, or several for the virtual-stage schedules)."""
        return list(self._mine)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's pipeline replica: the rows of the global batch it takes."""
        return self.mesh.where.replica

    def train(self, mode: bool = True) -> DistributedModelPipe:
        super().train(mode)
        self._model.train(mode)  # the model's own flag, read by its forward
        return self

    # -- running ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the model on a mini-batch: under ``torch.no_grad()`` (or
        ``torch.inference_mode()``), called on every rank of the pipeline with the same
        arguments, the forward actions of the schedule run and the ranks of the last stage
        return what the model returns, joined over the micro-batches as by
        :class:`~pipepar.program.pipe.ModelPipe` (e.g. a ``ModelOutput`` with ``logits`` and,
        given ``labels=``, the loss of this replica's batch); every other rank returns
        ``None``. Values that only other ranks compute (e.g. the hidden states of earlier
        stages, if the model returns them) are on the ``meta`` device. Nothing is kept for a
        backward: to train, use :meth:`step`.

        Raises:
            TypeError: with gradients enabled (a rank cannot run the backward of a call).

        Example:
            >>> with torch.no_grad():  # doctest: +SKIP
            ...     out = pipe.eval()(**batch)  # None except on the last stage's ranks
        """
        if torch.is_grad_enabled():
            raise TypeError(
                "a rank holds only its own stages, so pipe(...) cannot run a backward; call "
                "pipe.step(**batch) for a training step, or pipe(**batch) under "
                "torch.no_grad() to evaluate (the last stage's ranks get the output)"
            )
        calls = split_call(args, kwargs, self.chunks)
        schedule = fewer_microbatches(self.schedule, len(calls))
        shares = ModelLoss(self._model, calls) if "labels" in kwargs else None
        batch, _ = self._guarded(lambda: self._gathered_walk(calls, schedule, shares))
        if self.schedule.n_stages - 1 not in self._mine:
            return None
        return joined([d.result for d in batch.drivers], [c.rows for c in calls], shares)

    @_stepping
    def step(
        self,
        *args: Any,
        loss_fn: LossFn | None = None,
        target: Any = None,
        items: Items | None = None,
        **kwargs: Any,
    ) -> float:
        """Forward and backward of one mini-batch; returns the loss on every rank.

        Call it on every rank of the pipeline with the same arguments (the batch the model
        takes: e.g. ``input_ids=..., labels=...``); each replica with its own batch. The loss is
        the model's own (``labels=``) or ``loss_fn(output, target)``, joined into the loss of
        the batches of all replicas together, whatever it averages over (rows, real tokens,
        ``num_items_in_batch``; ``items`` for a custom ``loss_fn``: see
        :meth:`pipepar.program.pipe.ModelPipe.step`). Gradients accumulate into ``.grad``,
        summed over the stages that share a tied weight and averaged over the replicas.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` (on every rank) it evaluates:
        only the forward actions of the schedule run, the same loss comes back on every rank,
        ``.grad`` is untouched and no activation is kept for a backward (call ``pipe.eval()``
        first for dropout off).
        """
        calls = split_call(args, kwargs, self.chunks)
        if calls[0].rows == 0:
            raise ValueError(
                "the batch has no rows: pass at least one sample on dimension 0 of the tensors "
                "of pipe.step(...) (every rank of the pipeline gets the same batch)"
            )
        schedule = fewer_microbatches(self.schedule, len(calls))
        targets = split_target(target, [c.rows for c in calls])
        shares = spread_over_replicas(
            step_shares(loss_fn, self._model, calls, targets, items),
            mesh=self.mesh,
            device=self.device,
        )
        grad = torch.is_grad_enabled()
        with self._gathered():  # sharded: gathered once for every action of the step
            head = loss_head(shares, targets)
            batch, steps = self._walk(calls, schedule, shares, head, grad=grad)
            if grad:
                self._write_grads(steps)
        return self._loss(batch, shares.weights)

    def _gathered_walk(
        self, calls: list[Call], schedule: Schedule, shares: ModelLoss | None
    ) -> tuple[Batch, list[RankStep]]:
        with self._gathered():
            return self._walk(calls, schedule, shares, None, grad=False)

    def _walk(
        self,
        calls: list[Call],
        schedule: Schedule,
        shares: LossShares | ModelLoss | None,
        head: Callable[[Any, int], Tensor] | None,
        *,
        grad: bool,
    ) -> tuple[Batch, list[RankStep]]:
        """Run this rank's actions of ``schedule`` on the micro-batch ``calls``: the own
        stages' for real, the others in shadow; without ``grad`` the forward ones only, and
        nothing is kept for a backward."""
        weights = shares.weights if shares is not None else None
        flags = (self._model.training, grad, head is not None, isinstance(shares, ModelLoss))
        cuts = [
            RankCut(
                Ledger(),
                self._owner,
                [self.device] * self.schedule.n_stages,
                {},
                mine=self._mine,
                link=self._link,
                values=MetaScalars(),
                routes=self._routes,
                key=signature(c.args, c.kwargs, *flags),
            )
            for c in calls
        ]
        shadow = shadow_context(cuts, grad)

        def context(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
            # ``steps`` are made below, before any driver runs.
            own = steps.get(stage)
            return own.segment_context(stage, i) if own is not None else shadow(stage, i)

        batch = Batch(
            callers(self._model, calls, shares), cuts, context, head=head, weights=weights
        )
        steps = {
            stage.index: RankStep(
                stage,
                len(calls),
                batch=batch,
                params=self._trained(stage.index),
                checkpoint=self.checkpoint,
                grad=grad,
                input_grad=True,
                streams=None,  # one driver computes at a time: draws in order
                split=functools.partial(schedule.splits_backward, stage.index),
                cuts=cuts,
                link=self._link,
                mine=self._mine,
            )
            for stage in self._stages
        }
        with committing([layer for stage in self._stages for layer in stage.layers]):
            self._run(batch, steps, schedule, grad)
        return batch, list(steps.values())

    def _run(
        self, batch: Batch, steps: Mapping[int, RankStep], schedule: Schedule, grad: bool
    ) -> None:
        """This rank's actions in the schedule's order (the forward ones only without
        ``grad``: each waits only on forwards, so they keep their order)."""
        pool = self._driver_threads(len(batch.drivers))
        for driver in batch.drivers:
            pool.submit(driver.run)
        actions = [a for a in schedule.worker(self.mesh.stage) if grad or a.kind == "F"]
        try:
            for action in actions:
                step, i = steps[action.stage], action.microbatch
                self.mesh.progress.begin(describe(action, several=len(steps) > 1))
                if action.kind == "F":
                    step.forward(i, ())
                elif action.kind == "B":
                    step.backward(i, ())
                else:
                    step.weight(i)
        except BaseException:
            batch.abort()
            raise
        self.mesh.progress.begin("end of the mini-batch")
        self._link.flush()

    def _trained(self, s: int) -> list[nn.Parameter]:
        """The weights own stage ``s`` holds that take a gradient."""
        return [p for p in self._held if self._owner[id(p)] == s and p.requires_grad]

    def _write_grads(self, steps: Sequence[RankStep]) -> None:
        """Add this step's gradients into ``.grad``: each tied weight's summed over the stages
        that use it (on this rank, then over the ranks), all averaged over the replicas. Only
        the step's own gradients are reduced (``.grad`` may hold earlier steps' already:
        accumulation); a frozen weight gets none."""
        fresh: dict[int, Tensor | None] = {}
        for step in steps:
            fresh.update((id(p), g) for p, g in zip(step.params, step.param_grads()))
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
                    self.mesh.progress.all_reduce(g, group, "the sum of tied weights")
        if self._sync is not None:
            self._scatter(fresh)
            return
        if self.mesh.dp_group is not None:
            for p in self._held:
                g = fresh.get(id(p))
                if p.requires_grad and g is not None:
                    self.mesh.progress.all_reduce(g, self.mesh.dp_group, "the gradient all-reduce")
                    g /= self.dp
        for p in self._held:
            g = fresh.get(id(p))
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

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
        last = self.schedule.n_stages - 1
        value = torch.zeros(1, device=self.device)
        if last in self._mine:
            value += joined_loss([d.result for d in batch.drivers], weights)
        if self.mesh.ctl is not None:
            self.mesh.progress.all_reduce(value, self.mesh.ctl, "sharing the loss")
        if self.mesh.dp_group is not None:
            self.mesh.progress.all_reduce(value, self.mesh.dp_group, "averaging the loss")
            value /= self.dp
        return float(value.item())

    def _driver_threads(self, m: int) -> ThreadPoolExecutor:
        self._drivers = driver_pool(self._drivers, m, torch.get_num_threads(), self.device)
        return self._drivers

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients by the whole model's norm (every stage's, reduced over the
        pipeline's ranks; a weight tied across stages counted once, replicas once), exactly
        as ``torch.nn.utils.clip_grad_norm_`` on the plain model; returns the total norm, the
        same on every rank (with ``dp_shard``, each replica's shards once). Call it on every
        rank after ``step``.

        Example:
            >>> pipe.step(**batch)  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)  # doctest: +SKIP
        """
        elsewhere = {id(q) for first, _, ps in self._tied if first not in self._mine for q in ps}
        owned = [self._shard_of[id(q)] for q in self._held if id(q) not in elsewhere]
        return self._guarded(
            lambda: clipping.clip_grad_norm_(
                owned,
                self._shards,
                max_norm,
                norm_type,
                error_if_nonfinite,
                mesh=self.mesh,
                device=self.device,
                sharded=self.dp_shard,
            )
        )

    def close(self) -> None:
        if self._drivers is not None:
            self._drivers.shutdown(wait=False)
            self._drivers = None
        self._link.drop()
        if self._sync is not None:
            self._sync.drop()
        self._guarded.stop()
        self.mesh.close()


def _stage(lay: units_.Layout, stage_of_unit: Sequence[int], s: int, device: torch.device) -> Stage:
    """Stage ``s``: its units, named by their module paths."""
    units = list(units_.iter_stage_units(lay, stage_of_unit, s))
    start = sum(1 for t in stage_of_unit if t < s)
    names = [u.path.replace(".", "/") for u in units]
    return Stage(s, start, [u.module for u in units], device, names=names)
