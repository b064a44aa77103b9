"""How a rank runs its stages of an ``nn.Sequential``: a chain of layers, each stage's output
sent to the next stage's rank (:class:`RankChain`).

The rank materializes only its own stages' layers (:mod:`pipepar.distributed.stage`), walks
its actions of the schedule through the rank executor (:class:`~pipepar.ranks.runtime.Runtime`)
and hands values over a channel per stage boundary (:class:`~pipepar.ranks.transport.Transport`);
gradients are averaged over the replicas bucket by bucket as their stages finish
(:class:`~pipepar.ranks.replicas.GradientSync`), or reduce-scattered into shards
(:class:`~pipepar.ranks.sharding.ShardedSync`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.core.batchnorm import committing, defer_statistics
from pipepar.core.first_calls import FirstCalls
from pipepar.core.losses import LossShares
from pipepar.core.microbatch import Value, gather
from pipepar.core.stage import Stage
from pipepar.distributed.stage import build_stage, in_model_order
from pipepar.local.chain import ChainCall
from pipepar.ranks.arguments import check_model
from pipepar.ranks.failure import comm
from pipepar.ranks.pipe_context import PipeContext
from pipepar.ranks.replicas import (
    GradientSync,
    broadcast_from_first,
    check_replica_inputs,
    spread_over_replicas,
)
from pipepar.ranks.runtime import Runtime
from pipepar.ranks.sharding import ShardedSync, shard_like
from pipepar.ranks.transport import Transport

__all__ = ["RankChain"]

T = TypeVar("T")


class RankChain:
    """An ``nn.Sequential`` split by ``balance`` (layers per stage) over the ranks."""

    default_checkpoint = "except_last"

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None,
        *,
        deferred_batch_norm: bool,
        batch_coupling: str = "error",
    ) -> None:
        chain, self.sizes = check_model(model, balance)
        defer_statistics(chain, deferred_batch_norm)
        self._watch = FirstCalls(chain, batch_coupling, deferred_batch_norm)
        self.model: nn.Sequential = chain
        self.layer_names: list[str] = list(chain._modules)
        """Names of the whole model's layers, in order (the first part of every key)."""

    def build(
        self, ctx: PipeContext, state_dict: Mapping[str, Tensor] | None, routes: bool
    ) -> None:
        """Materialize the rank's stages as the pipe's children and wire them to their
        transport, gradient sync and runtime (replicas start from replica 0's weights unless
        ``state_dict`` is given). ``routes`` concerns other models only."""
        self._ctx = ctx
        pipe, mesh = ctx.module, ctx.mesh
        stages = []
        for s in ctx.stages:
            part = build_stage(self.model, self.sizes, s, device=ctx.device, state_dict=state_dict)
            for name, layer in part.named_children():
                ctx.adopt(name, layer)
            layers = list(part.children())
            stages.append(Stage(s, sum(self.sizes[:s]), layers, ctx.device, watch=self._watch))
        if state_dict is None:  # before sharding: each replica keeps its shard of the same
            ctx.guard(lambda: broadcast_from_first(_tensors(pipe), mesh))
        window = ctx.schedule.worker_in_flight(mesh.stage)
        self._transport = Transport(mesh, ctx.device, send_window=window)
        self._sync: GradientSync = (
            ShardedSync(list(pipe.children()), mesh, ctx.device)
            if ctx.dp_shard
            else GradientSync(pipe, mesh)
        )
        self._runtime = Runtime(
            stages,
            mesh,
            self._transport,
            ctx.schedule,
            ctx.checkpoint,
            recompute=ctx.recompute,
            on_final=self._sync.ready,
            offload=ctx.offload,
            asked=ctx.asked,
        )

    # -- running --------------------------------------------------------------------------------
    def step(self, call: ChainCall) -> float:
        """One mini-batch forward and backward (or, under no_grad, its forwards only); the
        loss over the replicas, on every rank (see :meth:`DistributedPipe.step`)."""
        with committing(list(self._ctx.module.children())):
            if not torch.is_grad_enabled():
                return self._ctx.guard(lambda: self._evaluate(call))
            return self._ctx.guard(lambda: self._step(call))

    def _evaluate(self, call: ChainCall) -> float:
        ctx = self._ctx
        spread = functools.partial(spread_over_replicas, mesh=ctx.mesh, device=ctx.device)
        x, target = _batch_of(call)
        with self._sync.gathered():
            loss_sum = self._runtime.run(
                x, target, call.loss_fn, items=call.items, spread=spread, grad=False
            )
        loss = None if loss_sum is None else self._replica_mean(loss_sum.float().reshape(1))
        return self._share_loss(loss)

    def _step(self, call: ChainCall) -> float:
        mesh, device = self._ctx.mesh, self._ctx.device
        x, target = _batch_of(call)
        same_inputs = check_replica_inputs(x, mesh, device) if mesh.stage == 0 else None
        self._sync.arm()

        def spread(shares: LossShares) -> LossShares:
            return spread_over_replicas(shares, mesh=mesh, device=device).scaled(call.scale)

        with self._sync.gathered():  # sharded: all-gathered once for every action of the step
            loss_sum = self._runtime.run(x, target, call.loss_fn, items=call.items, spread=spread)
            if same_inputs is not None:  # before the averaged gradients are written back
                same_inputs()
            loss = None if loss_sum is None else loss_sum.float().reshape(1)
            self._sync.finish(extra=loss)  # buckets were posted as their stages finished
        self._ctx.schedule = self._runtime.full  # placed again once the stages are timed
        return self._share_loss(loss)

    def _replica_mean(self, loss: Tensor) -> Tensor:
        """The mean of the replicas' losses (each a share of the batch of every replica), as
        ``step`` averages it with the gradients."""
        mesh = self._ctx.mesh
        if mesh.dp_group is None:
            return loss
        what = f"averaging the loss over ranks {mesh.replica_ranks}"
        with comm(what):
            work = dist.all_reduce(loss, group=mesh.dp_group, async_op=True)
        mesh.progress.wait(work, what)
        return loss / self._ctx.dp

    def _share_loss(self, loss: Tensor | None) -> float:
        """Give the last stage's loss to every stage of the pipeline.

        An all-reduce (other stages add zero) rather than a broadcast: it completes only once
        every stage finished its step, so no rank returns from a step that another rank of the
        grid failed (a failed rank never reaches it, and a replica that lost a rank blocks its
        peer replicas' gradient all-reduce, hence their loss all-reduce, until it fails too).
        """
        mesh = self._ctx.mesh
        if mesh.ctl is None:
            assert loss is not None  # a single stage is the last stage
            return float(loss.item())
        value = loss if loss is not None else torch.zeros(1, device=self._ctx.device)
        what = f"sharing the loss over ranks {mesh.pipeline_ranks}"
        with comm(what):
            work = dist.all_reduce(value, group=mesh.ctl, async_op=True)
        mesh.progress.wait(work, what)
        return float(value.item())

    def forward(self, x: Value | None) -> Value | None:
        """The forwards of a mini-batch under no_grad: the joined output on the last stage's
        ranks, None on the others."""
        with committing(list(self._ctx.module.children())):
            outputs = self._ctx.guard(lambda: self._gathered_forward(x))
        return None if outputs is None else gather(outputs)

    def _gathered_forward(self, x: Value | None) -> list[Value] | None:
        with self._sync.gathered():
            return self._runtime.forward(x)

    # -- what the rank holds --------------------------------------------------------------------
    def in_model_order(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A whole model's entries in the plain model's order."""
        return in_model_order(state, self.layer_names)

    def parameters(self, recurse: bool = True) -> Any:
        """The rank's layers' parameters (with ``dp_shard``, their shards)."""
        return nn.Module.parameters(self._ctx.module, recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return nn.Module.named_parameters(self._ctx.module, *args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The rank's layers' entries under the model's keys."""
        return nn.Module.state_dict(self._ctx.module, *args, **kwargs)

    def own_state(self, state: Mapping[str, T]) -> dict[str, T]:
        """The entries every gather of the whole model takes from this rank: all of them (the
        rank builds only its own stages' layers, each layer once)."""
        return dict(state)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
        """Load the entries of a whole-model (or local) state_dict for the rank's layers (with
        ``dp_shard``, each replica's shard of them); the other layers' are ignored."""
        pipe = self._ctx.module
        own = dict(pipe.named_parameters())
        local = {
            k: shard_like(v, own[k]) if k in own else v
            for k, v in state_dict.items()
            if k.split(".", 1)[0] in pipe._modules
        }
        return nn.Module.load_state_dict(pipe, local, strict=strict, assign=assign)

    def clipped(self) -> tuple[list[Tensor], list[Tensor]]:
        """The parameters whose gradients the rank counts in the norm, and those it clips."""
        params: list[Tensor] = list(self._ctx.module.parameters())
        return params, params

    def close(self) -> None:
        """Release the transport's and the gradient sync's groups."""
        self._transport.drop()
        self._sync.drop()


def _batch_of(call: ChainCall) -> tuple[Any, Any]:
    """What the runtime takes: the batch and its target, or the micro-batches the caller made
    and their targets (lists, which the runtime takes as they are)."""
    if call.given is None:
        return call.input, call.target
    return call.given.microbatches, call.given.targets


def _tensors(pipe: nn.Module) -> list[Tensor]:
    return [t.data for t in list(pipe.parameters()) + list(pipe.buffers())]
