"""DistributedPipe: this rank's stages of any model split over the ranks of a pipeline, replicated
``dp`` times (pp x dp), or with ``dp_shard=True`` sharded over the ``dp`` ranks of each position
(:mod:`pipepar.ranks.sharding`).

One class for every model, as :class:`~pipepar.pipe.Pipe` is in one process. A rank runs
one stage, or several with the virtual-stage schedules (``"interleaved-1f1b"``, ``"zb-v"``,
``"v-half"``, ``"v-min"``: balance lists two stages per rank). How a micro-batch crosses the
stages is the pipe's *compute*: an ``nn.Sequential`` split by ``balance`` is a chain of layers,
each stage's output sent to the next rank (:class:`~pipepar.distributed.chain.RankChain`); any
other model runs its own ``forward`` on every rank, its own stages for real
(:class:`~pipepar.program.rank_compute.RankProgram`). Launched with
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

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.batching.calls import StepCall
from pipepar.batching.rules import CHAIN_RULES, InputRule, OutputRule, Rules
from pipepar.core import validation
from pipepar.core.garbage import StepCollector
from pipepar.core.given import check_given
from pipepar.core.loss_scale import LossScaler, loss_scale
from pipepar.core.losses import Items
from pipepar.core.recompute_placement import check_placement, placed_for
from pipepar.core.schedule import Schedule
from pipepar.distributed.chain import RankChain
from pipepar.local.chain import chain_step_arguments, is_chain, one_input
from pipepar.local.placement import StaysPlaced
from pipepar.program.losses import LossFn
from pipepar.program.rank_compute import RankProgram
from pipepar.ranks import clipping, handshake
from pipepar.ranks.arguments import SCHEDULES, check_schedule, check_timeout
from pipepar.ranks.failure import comm
from pipepar.ranks.guard import Guard
from pipepar.ranks.mesh import Mesh, build_mesh, check_grid
from pipepar.ranks.overflow import agree_overflow
from pipepar.ranks.pipe_context import PipeContext
from pipepar.ranks.process import ensure_process_group, resolve_device
from pipepar.ranks.sharding import check_dp_shard, full_tensors

__all__ = ["SCHEDULES", "DistributedPipe"]

logger = logging.getLogger(__name__)


class DistributedPipe(StaysPlaced):
    """This rank's stages of a model split over the ranks of a pipeline, with ``dp`` replicas.

    Build it with :func:`pipepar.distributed.wrap` on every rank, with the same arguments. The
    rank keeps only the weights its stages use (a weight tied across stages on every rank that
    uses it): build the model on the ``meta`` device and pass ``state_dict``, or build it real
    and the other stages' weights are dropped. ``parameters()`` and ``state_dict()`` cover the
    rank's own weights under the model's names; :meth:`full_state_dict` gathers the whole
    model. With ``dp_shard=True`` they are this replica's ``DTensor`` shards of them, and so
    are their gradients (see :mod:`pipepar.ranks.sharding`). ``order`` lists the units' paths in
    the order ``balance`` counts them (:func:`pipepar.distributed.wrap` finds it from its
    ``sample``); None: the order the model registers them in.

    Attributes beside those of :class:`~pipepar.local.pipe.Pipe` (``balance``, ``chunks``,
    ``checkpoint``, ``schedule``, ``layout``): ``stages`` (the stage indices this rank runs),
    ``stage_index`` (its first), ``dp_rank`` (its replica) and ``device``.

    Example:
        >>> # under torchrun --nproc-per-node 4: two stages x two replicas
        >>> import pipepar.distributed as ppd
        >>> pipe = ppd.wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(pipe.parameters())  # this rank's weights  # doctest: +SKIP
        >>> loss = pipe.step(x, y, nn.functional.mse_loss)  # every rank  # doctest: +SKIP
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
        >>> ppd.save_checkpoint("run/ckpt", pipe, opt)  # sharded, atomic  # doctest: +SKIP
    """

    _model: nn.Module  # not a child: its children (this rank's stages' modules) are the pipe's

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        *,
        split: Sequence[str] | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        dp: int = 1,
        checkpoint: str | None = None,
        recompute: str = "in_place",
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        timeout: float | None = 300.0,
        routes: bool = True,
        deferred_batch_norm: bool = False,
        batch_coupling: str = "error",
        split_inputs: Mapping[str | int, InputRule] | None = None,
        join_outputs: Mapping[str, OutputRule] | None = None,
        dp_shard: bool = False,
        gc_every: int | None = None,
        offload: bool = False,
        order: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        try:
            self.offload = validation.check_offload(offload)
            if checkpoint is None and self.offload:  # offload, not recompute
                checkpoint = "never"
            compute = self._configure(
                model, balance, split, chunks, schedule, dp, checkpoint, timeout, group,
                deferred_batch_norm, batch_coupling, Rules.given(split_inputs, join_outputs),
                order,
            )  # fmt: skip
            self._place_recomputes(recompute)
            self.dp_shard = check_dp_shard(dp_shard, self.dp)
            self._collector = StepCollector(gc_every)
        except (ValueError, TypeError) as error:
            if dist.is_initialized():  # peers must not wait for this rank: tell them why
                handshake.refuse(error, group=group)
            raise
        # -- from here on ranks talk to each other ----------------------------------------------
        fields = handshake.fingerprint(
            compute.model,
            self.balance,
            chunks=self.chunks,
            schedule=self.schedule,
            dp=self.dp,
            checkpoint=self.checkpoint,
            state_dict=state_dict,
        )
        extra = {"dp_shard": str(self.dp_shard), "routes": str(routes), "gc_every": str(gc_every)}
        handshake.agree(fields | extra, group=group, timeout=self.timeout)
        self.group = group
        """The parent group of the grid (``None``: the world)."""
        self.device = resolve_device(device, group)
        self.mesh: Mesh = build_mesh(
            self.schedule.n_workers,
            self.dp,
            group=group,
            timeout=None if self.timeout is None else timedelta(seconds=self.timeout),
            placement=self.schedule.placement,
        )
        self._guarded = Guard(self, self.mesh, self.close)
        context = PipeContext(
            self, self.mesh, self.schedule, self.device, self.chunks, self.checkpoint, self.dp,
            self.dp_shard, self._guarded, self.recompute, self.offload, self._asked,
        )  # fmt: skip
        compute.build(context, state_dict, routes)
        self._context = context

    def _configure(
        self,
        model: nn.Module,
        balance: Sequence[int] | None,
        split: Sequence[str] | None,
        chunks: int,
        schedule: str | Schedule,
        dp: int,
        checkpoint: str | None,
        timeout: float | None,
        group: dist.ProcessGroup | None,
        deferred_batch_norm: bool,
        batch_coupling: str,
        rules: Rules,
        order: Sequence[str] | None,
    ) -> RankChain | RankProgram:
        """Check this rank's arguments on their own (no communication) and keep them; the
        compute of the model."""
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be an nn.Module, but got {type(model).__name__}; pass the model "
                "to split"
            )
        self.chunks = validation.check_chunks(chunks)
        if checkpoint is not None:
            checkpoint = validation.check_checkpoint(checkpoint)
        self.timeout = check_timeout(timeout)
        if rules and is_chain(model, split):
            raise TypeError(CHAIN_RULES)
        compute: RankChain | RankProgram = (
            RankChain(
                model,
                balance,
                deferred_batch_norm=deferred_batch_norm,
                batch_coupling=batch_coupling,
            )
            if is_chain(model, split)
            else RankProgram(
                model,
                balance,
                split=split,
                deferred_batch_norm=deferred_batch_norm,
                batch_coupling=batch_coupling,
                rules=rules,
                order=order,
            )
        )
        self._compute = compute
        # Not a child: its children (this rank's stages' modules) become the pipe's.
        object.__setattr__(self, "_model", compute.model)
        self.checkpoint: str = checkpoint or compute.default_checkpoint
        self.balance: list[int] = list(compute.sizes)
        """Units (an ``nn.Sequential``'s layers) per stage, of the whole pipeline."""
        self._schedule = self._asked = check_schedule(schedule, len(self.balance), self.chunks)
        ensure_process_group()
        self.dp = check_grid(
            dist.get_world_size(group), self._schedule.n_workers, dp, n_stages=len(self.balance)
        )
        return compute

    def _place_recomputes(self, recompute: str) -> None:
        """``recompute=``, checked; the schedule every rank runs with its recomputes placed
        on unit costs (the same on every rank: the placement is a function of the schedule;
        the compute places them again on the stages' times, shared by every rank)."""
        self.recompute = check_placement(recompute, self.checkpoint)
        self._schedule = placed_for(self._asked, self.recompute, self.checkpoint)

    @property
    def schedule(self) -> Schedule:
        """What every rank of the pipeline runs for a full mini-batch; with
        ``recompute="bubbles"``, its recomputes placed on the stages' times measured in the
        second training step, from the third on (:mod:`pipepar.ranks.shared_times`)."""
        context: PipeContext | None = self.__dict__.get("_context")
        return self._schedule if context is None else context.schedule

    # -- grid position ------------------------------------------------------------------------
    @property
    def compute(self) -> RankChain | RankProgram:
        """How this rank runs its stages: a chain of layers (an ``nn.Sequential``) or the
        model's own forward (any other model)."""
        return self._compute

    @property
    def module(self) -> nn.Module:
        """The wrapped model (on this rank: its own stages' weights real, the others' on
        ``meta`` or dropped)."""
        return self._model

    @property
    def stage_index(self) -> int:
        """This rank's position in the pipeline, 0 to ``pp - 1`` (the schedule's worker index).

        It is the rank's stage when ranks run one stage each; under the virtual-stage
        schedules a rank runs several stages, listed by :attr:`stages` (position ``w`` runs
        stages ``w`` and ``w + pp`` with ``"interleaved-1f1b"``, ``w`` and ``2 * pp - 1 - w``
        with ``"zb-v"``, ``"v-half"`` and ``"v-min"``)."""
        return self.mesh.stage

    @property
    def stages(self) -> list[int]:
        """Indices of the stages this rank runs, in stage order (one, or several for the
        virtual-stage schedules)."""
        return self.schedule.stages_of(self.mesh.stage)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's pipeline replica: the rows of the global batch it takes."""
        return self.mesh.where.replica

    @property
    def pp(self) -> int:
        """Ranks per pipeline: the number of stages, or half of it for the virtual-stage
        schedules."""
        return self.mesh.pp

    def train(self, mode: bool = True) -> DistributedPipe:
        super().train(mode)
        self._model.train(mode)  # the model's own flag, read by its forward
        return self

    # -- placement is the pipe's job (StaysPlaced: to(device), cuda(), cpu()) --------------
    def stage_devices(self) -> list[torch.device]:
        return [self.device]

    # -- training -----------------------------------------------------------------------------
    def step(
        self,
        *args: Any,
        loss_fn: LossFn | None = None,
        target: Any = None,
        items: Items | None = None,
        scaler: LossScaler | None = None,
        microbatches: list[Any] | None = None,
        targets: list[Any] | None = None,
        **kwargs: Any,
    ) -> float:
        """Run one mini-batch forward and backward; return its loss on every rank.

        Call it on every rank of the pipeline. An ``nn.Sequential``'s pipe takes
        ``step(x, target, loss_fn)``: stage 0 reads ``x``, the last stage reads ``target``,
        other ranks may pass ``None`` for either. Any other model's takes the model's own
        arguments (``input_ids=..., labels=...``), the same batch on every rank of a
        pipeline, and ``loss_fn=``/``target=`` by name; its loss is the model's own
        (``labels=``) or ``loss_fn(output, target)``. Each replica trains on its own
        mini-batch. The batch is split into ``chunks`` micro-batches, and their losses are
        joined into the loss of the batches of all replicas together, whatever it averages
        over (rows, real targets of a cross-entropy with ``ignore_index``, real tokens,
        ``num_items_in_batch``, ``items(target_i)`` for a custom loss: see
        :mod:`pipepar.core.losses`), so the gradients equal the plain model's on the batches
        of all replicas together. Gradients accumulate into ``.grad`` (call ``zero_grad()``
        between steps), summed over the stages that share a tied weight and averaged over
        the replicas.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` (on every rank) it evaluates:
        only the forward actions of the schedule run, the same loss comes back on every rank,
        ``.grad`` is untouched and no activation is kept for a backward (call ``pipe.eval()``
        first for dropout off).

        ``scaler=`` (a ``torch.amp.GradScaler``, the same settings on every rank) scales the
        loss as with the plain model (see :meth:`pipepar.pipe.Pipe.step`). A gradient
        that overflows on any rank then counts on every rank (:mod:`pipepar.ranks.overflow`),
        so ``scaler.step(opt)`` skips on all of them or none, and every scale stays the same.

        ``microbatches=[mb0, mb1, ...]`` (with ``loss_fn=``, ``targets=[t0, t1, ...]``) runs
        micro-batches you made, as :meth:`pipepar.pipe.Pipe.step` does; pass the same
        lists on every rank of a pipeline (an ``nn.Sequential``'s stage 0 reads
        ``microbatches``, its last stage ``targets``). They may differ in rows and in other
        sizes (sequence lengths): every rank learns each micro-batch's shapes.

        Returns:
            The loss of the whole batch over the replicas, the same float on every rank.

        Raises:
            PipelineError: on every rank when any rank of the grid fails, naming that rank.

        Example:
            >>> loss = pipe.step(x, y, nn.functional.mse_loss)  # doctest: +SKIP
            >>> loss = pipe.step(input_ids=ids, labels=ids)  # doctest: +SKIP
        """
        given, kwargs = check_given(
            microbatches, targets, loss_fn=loss_fn, target=target, args=args, kwargs=kwargs
        )
        scale = loss_scale(scaler, self.device)
        with self._collector.step():
            if isinstance(self._compute, RankChain):
                call = chain_step_arguments(
                    args, kwargs, target, loss_fn, items, name="x", given=given
                )
                loss = self._compute.step(replace(call, scale=scale))
            else:
                step_call = StepCall(args, kwargs, loss_fn, target, items, scale, given)
                loss = self._compute.step(step_call)
        if scaler is not None and scaler.is_enabled() and torch.is_grad_enabled():
            held = self._compute.clipped()[1]
            self._guarded(lambda: agree_overflow(held, scale, mesh=self.mesh, device=self.device))
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the model on a mini-batch: under ``torch.no_grad()`` (or
        ``torch.inference_mode()``), called on every rank of the pipeline, the forward actions
        of the schedule run and the ranks of the last stage return what the model returns,
        joined over the micro-batches as by the one-process pipe (an ``nn.Sequential``'s
        last layer's output; e.g. a ``ModelOutput`` with ``logits`` and, given ``labels=``,
        the loss of this replica's batch); every other rank returns ``None``. An
        ``nn.Sequential``'s stage 0 reads ``x`` (other ranks may pass ``None``); any other
        model gets the same arguments on every rank, and values that only other ranks compute
        (e.g. the hidden states of earlier stages, if the model returns them) are on the
        ``meta`` device. Nothing is kept for a backward: to train, use :meth:`step`.

        Raises:
            TypeError: with gradients enabled (a rank cannot run the backward of a call).

        Example:
            >>> with torch.no_grad():  # doctest: +SKIP
            ...     logits = pipe.eval()(x)  # None except on the last stage's ranks
        """
        if torch.is_grad_enabled():
            raise TypeError(
                "a rank holds only its own stages, so pipe(...) cannot run a backward; call "
                "pipe.step(...) for a training step, or pipe(...) under torch.no_grad() to "
                "evaluate (the last stage's ranks get the output)"
            )
        if isinstance(self._compute, RankChain):
            return self._compute.forward(one_input(args, kwargs, name="x"))
        return self._compute.forward(args, kwargs)

    # -- what this rank holds -----------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        """This rank's weights (each once; with ``dp_shard``, their ``DTensor`` shards)."""
        return self._compute.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._compute.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """This rank's entries under the model's keys (with ``dp_shard``, the shards)."""
        return self._compute.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the whole model's state_dict, or this rank's entries of it: the entries of
        other stages are ignored; with ``dp_shard``, each replica keeps its shard of the
        weights it holds."""
        return self._compute.load_state_dict(state_dict, strict, assign)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state_dict (original keys, CPU tensors, the plain model's order),
        gathered on every rank (with ``dp_shard``, each tensor gathered whole from its shards
        first). Each entry comes from the stage that computes it: a weight from the stage
        holding it, a buffer (batch-norm statistics) from the stage whose units update it
        (:func:`pipepar.program.units.state_owners`). Call it on every rank.

        Example:
            >>> torch.save(pipe.full_state_dict(), "model.pt")  # doctest: +SKIP
        """
        parts: list[Any] = [None] * self.pp
        self._guarded(lambda: self._gather(parts))
        merged = {k: v for part in parts for k, v in part.items()}  # parts do not overlap
        return self._compute.in_model_order(merged)

    def _gather(self, parts: list[Any]) -> None:
        what = f"gathering the state_dict over ranks {self.mesh.grid_ranks}"
        with comm(what):
            own = full_tensors(self._compute.own_state(self.state_dict()))
            local = {k: v.detach().cpu() for k, v in own.items()}
            if self.mesh.ctl is None:
                parts[:] = [local]
            else:
                dist.all_gather_object(parts, local, group=self.mesh.ctl)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients by the whole model's norm (every stage's, reduced over the
        pipeline's ranks; a weight tied across stages counted once, replicas, which hold the
        same averaged gradients, once; with ``dp_shard``, each replica's shards once), exactly
        as ``torch.nn.utils.clip_grad_norm_`` on the plain model; returns the total norm, the
        same on every rank. Call it on every rank after ``step``.

        Example:
            >>> pipe.step(x, y, loss_fn)  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)  # doctest: +SKIP
        """
        counted, clipped = self._compute.clipped()
        return self._guarded(
            lambda: clipping.clip_grad_norm_(
                counted,
                clipped,
                max_norm,
                norm_type,
                error_if_nonfinite,
                mesh=self.mesh,
                device=self.device,
                sharded=self.dp_shard,
            )
        )

    def close(self) -> None:
        """Release this pipeline's threads and process groups (the pipe cannot step
        afterwards)."""
        self._compute.close()
        self._guarded.stop()
        self.mesh.close()

    def extra_repr(self) -> str:
        return (
            f"stages={self.stages}, position={self.stage_index}/{self.pp}, "
            f"replica={self.dp_rank}/{self.dp}{' sharded' if self.dp_shard else ''}, "
            f"chunks={self.chunks}, schedule={self.schedule.name!r}, checkpoint={self.checkpoint!r}"
        )
