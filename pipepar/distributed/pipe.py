"""DistributedPipe: this rank's stages of a pipeline over ranks, replicated ``dp`` times (pp x dp),
or with ``dp_shard=True`` sharded over the ``dp`` ranks of each position
(:mod:`pipepar.ranks.sharding`).

A rank runs one stage, or several with the virtual-stage schedules (``"interleaved-1f1b"``,
``"zb-v"``: balance lists two stages per rank). Launched with
``torchrun --nproc-per-node 4 train.py``, where train.py does::

    import pipepar.distributed as ppd

    with torch.device("meta"):
        model = make_model()  # never allocated whole
    pipe = ppd.wrap(model, [3, 3], chunks=8, schedule="1f1b", dp=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # the local stages' parameters
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    opt.step()
    opt.zero_grad()
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import committing, convert_deferred_batch_norm
from pipepar.core.losses import Items, LossFn
from pipepar.core.microbatch import Value, gather
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.distributed.stage import build_stage, in_model_order
from pipepar.ranks import clipping, handshake
from pipepar.ranks.arguments import SCHEDULES, check_model, check_schedule, check_timeout
from pipepar.ranks.failure import comm
from pipepar.ranks.guard import Guard
from pipepar.ranks.mesh import Mesh, build_mesh, check_grid
from pipepar.ranks.process import ensure_process_group, resolve_device
from pipepar.ranks.replicas import (
    GradientSync,
    broadcast_from_first,
    check_replica_inputs,
    spread_over_replicas,
)
from pipepar.ranks.runtime import Runtime
from pipepar.ranks.sharding import ShardedSync, check_dp_shard, full_tensors, shard_like
from pipepar.ranks.transport import Transport

__all__ = ["SCHEDULES", "DistributedPipe"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DistributedPipe(nn.Module):
    """This rank's stages of a pipeline that spans ranks, with ``dp`` synchronized replicas.

    Build it with :func:`wrap`. Its children are the layers of all its stages under their
    names in the original model, so ``parameters()`` and ``state_dict()`` cover the local
    stages with the original keys; :meth:`full_state_dict` gathers the whole model. With
    ``dp_shard=True`` the parameters are this replica's ``DTensor`` shards of them (see
    :mod:`pipepar.ranks.sharding`), and so are their gradients and ``state_dict()``'s values.
    """

    def __init__(
        self,
        model: nn.Sequential,
        balance: list[int],
        *,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        dp: int = 1,
        checkpoint: str = "except_last",
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        timeout: float | None = 300.0,
        deferred_batch_norm: bool = False,
        dp_shard: bool = False,
    ) -> None:
        super().__init__()
        try:
            model = self._configure(
                model, balance, chunks, schedule, dp, checkpoint, timeout, group
            )
            self.dp_shard = check_dp_shard(dp_shard, self.dp)
            if deferred_batch_norm:
                model = convert_deferred_batch_norm(model)  # type: ignore[assignment]
        except (ValueError, TypeError) as error:
            if dist.is_initialized():  # peers must not wait for this rank: tell them why
                handshake.refuse(error, group=group)
            raise
        # -- from here on ranks talk to each other ----------------------------------------------
        handshake.agree(
            {
                **handshake.fingerprint(
                    model,
                    self.balance,
                    chunks=self.chunks,
                    schedule=self.schedule,
                    dp=self.dp,
                    checkpoint=self.checkpoint,
                    state_dict=state_dict,
                ),
                "dp_shard": str(self.dp_shard),
            },
            group=group,
            timeout=self.timeout,
        )
        self.device = resolve_device(device, group)
        self.mesh: Mesh = build_mesh(
            self.schedule.n_workers,
            self.dp,
            group=group,
            timeout=None if self.timeout is None else timedelta(seconds=self.timeout),
            placement=self.schedule.placement,
        )
        stages = []
        for s in self.stages:
            part = build_stage(model, self.balance, s, device=self.device, state_dict=state_dict)
            for name, layer in part.named_children():
                self.add_module(name, layer)
            start = sum(self.balance[:s])
            stages.append(Stage(s, start, list(part.children()), self.device))
        self.group = group
        """The parent group of the grid (``None``: the world)."""
        self._assemble(stages, same_start=state_dict is None)

    def _configure(
        self,
        model: nn.Sequential,
        balance: list[int],
        chunks: int,
        schedule: str | Schedule,
        dp: int,
        checkpoint: str,
        timeout: float | None,
        group: dist.ProcessGroup | None,
    ) -> nn.Sequential:
        """Check this rank's arguments on their own (no communication) and keep them."""
        model, self.balance = check_model(model, balance)
        self.layer_names: list[str] = list(model._modules)
        """Names of the whole model's layers, in order (the first part of every key)."""
        self.chunks = validation.check_chunks(chunks)
        self.checkpoint = validation.check_checkpoint(checkpoint)
        self.schedule = check_schedule(schedule, len(self.balance), self.chunks)
        self.timeout = check_timeout(timeout)
        ensure_process_group()
        self.dp = check_grid(
            dist.get_world_size(group), self.schedule.n_workers, dp, n_stages=len(self.balance)
        )
        return model

    def _assemble(self, stages: list[Stage], *, same_start: bool) -> None:
        """Wire the local stages to their transport, gradient sync, runtime and guard;
        ``same_start``: give every replica replica 0's weights first (like DDP)."""
        self._guarded = Guard(self, self.mesh, self.close)
        if same_start:  # before sharding: each replica then keeps its shard of the same weights
            self._guard(lambda: broadcast_from_first(self._tensors(), self.mesh))
        window = self.schedule.worker_in_flight(self.mesh.stage)
        self._transport = Transport(self.mesh, self.device, send_window=window)
        self._sync: GradientSync = (
            ShardedSync(list(self.children()), self.mesh, self.device)
            if self.dp_shard
            else GradientSync(self, self.mesh)
        )
        self._runtime = Runtime(
            stages,
            self.mesh,
            self._transport,
            self.schedule,
            self.checkpoint,
            on_final=self._sync.ready,
        )

    # -- grid position ------------------------------------------------------------------------
    @property
    def stage_index(self) -> int:
        """This rank's position in the pipeline, 0 to ``pp - 1`` (the schedule's worker index).

        It is the rank's stage when ranks run one stage each; under the virtual-stage
        schedules a rank runs several stages, listed by :attr:`stages` (position ``w`` runs
        stages ``w`` and ``w + pp`` with ``"interleaved-1f1b"``, ``w`` and ``2 * pp - 1 - w``
        with ``"zb-v"``)."""
        return self.mesh.stage

    @property
    def stages(self) -> list[int]:
        """Indices of the stages this rank runs, in stage order (one, or several for the
        virtual-stage schedules)."""
        return self.schedule.stages_of(self.mesh.stage)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's pipeline replica."""
        return self.mesh.where.replica

    @property
    def pp(self) -> int:
        """Ranks per pipeline: the number of stages, or half of it for the virtual-stage
        schedules."""
        return self.mesh.pp

    # -- training -----------------------------------------------------------------------------
    def step(
        self,
        x: Tensor | None,
        target: Tensor | None,
        loss_fn: LossFn,
        *,
        items: Items | None = None,
    ) -> float:
        """Run one mini-batch forward and backward; return its mean loss on every rank.

        Each replica trains on its own mini-batch: on a replica's ranks, ``x`` and ``target`` are
        that replica's whole mini-batch. Stage 0 reads ``x``, the last stage reads ``target``;
        other ranks may pass ``None`` for either. Both are split into ``chunks`` micro-batches
        (``tensor_split`` along dim 0). The micro-batch losses ``loss_fn(out_i, target_i)``
        are joined into the loss of the whole batch of every replica, whatever it averages
        over (rows, real targets of a cross-entropy with ``ignore_index``, ``items``: see
        :mod:`pipepar.core.losses`), so the gradients equal the plain model's on the batches
        of all replicas together. Gradients accumulate into ``.grad`` (call ``zero_grad()``
        between steps); the replicas' are averaged.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` (on every rank) it evaluates:
        only the forward actions of the schedule run, the same loss comes back on every rank,
        ``.grad`` is untouched and no activation is kept for a backward (call ``pipe.eval()``
        first for dropout off).

        Args:
            x: the mini-batch input (used on stage 0).
            target: the mini-batch target (used on the last stage).
            loss_fn: ``loss_fn(output, target) -> scalar tensor``.
            items: for a custom loss averaging over something other than rows,
                ``items(target_i)`` counts it in a micro-batch's target.

        Returns:
            The loss of the whole batch over the replicas, the same float on every rank.

        Raises:
            PipelineError: on every rank when any rank of the grid fails, naming that rank.

        Example:
            >>> loss = pipe.step(x, y, nn.functional.mse_loss)  # doctest: +SKIP
        """
        with committing(list(self.children())):
            if not torch.is_grad_enabled():
                return self._guard(lambda: self._evaluate(x, target, loss_fn, items))
            return self._guard(lambda: self._step(x, target, loss_fn, items))

    def _evaluate(
        self, x: Tensor | None, target: Tensor | None, loss_fn: LossFn, items: Items | None
    ) -> float:
        """``step`` under no_grad: the forwards only, the loss joined as ``step`` joins it."""
        spread = functools.partial(spread_over_replicas, mesh=self.mesh, device=self.device)
        with self._sync.gathered():
            loss_sum = self._runtime.run(x, target, loss_fn, items=items, spread=spread, grad=False)
        loss = None if loss_sum is None else self._replica_mean(loss_sum.float().reshape(1))
        return self._share_loss(loss)

    def _replica_mean(self, loss: Tensor) -> Tensor:
        """The mean of the replicas' losses (each a share of the batch of every replica), as
        ``step`` averages it with the gradients."""
        if self.mesh.dp_group is None:
            return loss
        what = f"averaging the loss over ranks {self.mesh.replica_ranks}"
        with comm(what):
            work = dist.all_reduce(loss, group=self.mesh.dp_group, async_op=True)
        self.mesh.progress.wait(work, what)
        return loss / self.dp

    def _step(
        self, x: Tensor | None, target: Tensor | None, loss_fn: LossFn, items: Items | None
    ) -> float:
        first = self.mesh.stage == 0
        same_inputs = check_replica_inputs(x, self.mesh, self.device) if first else None
        self._sync.arm()
        spread = functools.partial(spread_over_replicas, mesh=self.mesh, device=self.device)
        with self._sync.gathered():  # sharded: all-gathered once for every action of the step
            loss_sum = self._runtime.run(x, target, loss_fn, items=items, spread=spread)
            if same_inputs is not None:  # before the averaged gradients are written back
                same_inputs()
            loss = None if loss_sum is None else loss_sum.float().reshape(1)
            self._sync.finish(extra=loss)  # buckets were posted as their stages finished
        return self._share_loss(loss)

    def _share_loss(self, loss: Tensor | None) -> float:
        """Give the last stage's loss to every stage of the pipeline.

        An all-reduce (other stages add zero) rather than a broadcast: it completes only once
        every stage finished its step, so no rank returns from a step that another rank of the
        grid failed (a failed rank never reaches it, and a replica that lost a rank blocks its
        peer replicas' gradient all-reduce, hence their loss all-reduce, until it fails too).
        """
        if self.mesh.ctl is None:
            assert loss is not None  # a single stage is the last stage
            return float(loss.item())
        value = loss if loss is not None else torch.zeros(1, device=self.device)
        what = f"sharing the loss over ranks {self.mesh.pipeline_ranks}"
        with comm(what):
            work = dist.all_reduce(value, group=self.mesh.ctl, async_op=True)
        self.mesh.progress.wait(work, what)
        return float(value.item())

    def forward(self, x: Tensor | None) -> Value | None:
        """Evaluate the model on a mini-batch: under ``torch.no_grad()`` (or
        ``torch.inference_mode()``), on every rank of the pipeline, the forward actions of
        the schedule run and the ranks of the last stage return its output, joined over the
        micro-batches (the last layer's output for this replica's batch, as the one-process
        pipe returns it); every other rank returns ``None``. Stage 0 reads ``x``; other ranks
        may pass ``None``. Nothing is kept for a backward: to train, use :meth:`step`.

        Raises:
            TypeError: with gradients enabled (a rank cannot run the backward of a call).

        Example:
            >>> with torch.no_grad():  # doctest: +SKIP
            ...     logits = pipe.eval()(x)  # None except on the last stage's ranks
        """
        if torch.is_grad_enabled():
            raise TypeError(
                "a DistributedPipe holds only this rank's stages, so pipe(x) cannot run a "
                "backward; call pipe.step(x, target, loss_fn) for a training step, or pipe(x) "
                "under torch.no_grad() to evaluate (the last stage's ranks get the output)"
            )
        with committing(list(self.children())):
            outputs = self._guard(lambda: self._gathered_forward(x))
        return None if outputs is None else gather(outputs)

    def _gathered_forward(self, x: Tensor | None) -> list[Value] | None:
        with self._sync.gathered():
            return self._runtime.forward(x)

    # -- state --------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state_dict (original keys, CPU tensors), gathered on every rank
        (with ``dp_shard``, each tensor gathered whole from its shards first).

        Example:
            >>> torch.save(pipe.full_state_dict(), "model.pt")  # doctest: +SKIP
        """
        parts: list[Any] = [None] * self.pp
        self._guard(lambda: self._gather(parts))
        return in_model_order({k: v for part in parts for k, v in part.items()}, self.layer_names)

    def _gather(self, parts: list[Any]) -> None:
        what = f"gathering the state_dict over ranks {self.mesh.grid_ranks}"
        with comm(what):
            local = {k: v.detach().cpu() for k, v in full_tensors(self.state_dict()).items()}
            if self.mesh.ctl is None:
                parts[:] = [local]
            else:
                dist.all_gather_object(parts, local, group=self.mesh.ctl)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the local stages' entries of a whole-model (or local) state_dict (whole
        tensors; with ``dp_shard``, each replica keeps its shard of them)."""
        own = dict(self.named_parameters())
        local = {
            k: shard_like(v, own[k]) if k in own else v
            for k, v in state_dict.items()
            if k.split(".", 1)[0] in self._modules
        }
        return super().load_state_dict(local, strict=strict, assign=assign)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients by the whole model's norm (every stage's, reduced over the
        pipeline's ranks; replicas, which hold the same averaged gradients, count once; with
        ``dp_shard``, each replica's shards once), exactly as
        ``torch.nn.utils.clip_grad_norm_`` on the plain model; returns the total norm, the
        same on every rank. Call it on every rank after ``step``.

        Example:
            >>> pipe.step(x, y, loss_fn)  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)  # doctest: +SKIP
        """
        params = list(self.parameters())
        return self._guard(
            lambda: clipping.clip_grad_norm_(
                params,
                params,
                max_norm,
                norm_type,
                error_if_nonfinite,
                mesh=self.mesh,
                device=self.device,
                sharded=self.dp_shard,
            )
        )

    def close(self) -> None:
        """Release this pipeline's process groups (the pipe cannot step afterwards)."""
        self._transport.drop()
        self._sync.drop()
        self._guarded.stop()
        self.mesh.close()

    # -- helpers ------------------------------------------------------------------------------
    def _guard(self, fn: Callable[[], T]) -> T:
        return self._guarded(fn)

    def _tensors(self) -> list[Tensor]:
        return [t.data for t in list(self.parameters()) + list(self.buffers())]

    def extra_repr(self) -> str:
        return (
            f"stages={self.stages}, position={self.stage_index}/{self.pp}, "
            f"replica={self.dp_rank}/{self.dp}{' sharded' if self.dp_shard else ''}, "
            f"chunks={self.chunks}, schedule={self.schedule.name!r}, checkpoint={self.checkpoint!r}"
        )
