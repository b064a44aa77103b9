"""``pipepar.distributed.wrap``: an ``nn.Sequential`` becomes a
:class:`~pipepar.distributed.pipe.DistributedPipe`, any other model (or one split by module
paths) a :class:`~pipepar.program.rank_pipe.DistributedModelPipe`.

Above both routes: neither pipe knows about the other, nor about this choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.core.schedule import Schedule
from pipepar.distributed.pipe import DistributedPipe
from pipepar.program.rank_pipe import DistributedModelPipe

__all__ = ["wrap"]


def wrap(
    model: nn.Module,
    balance: list[int] | None = None,
    *,
    split: Sequence[str] | None = None,
    chunks: int = 1,
    schedule: str | Schedule = "gpipe",
    dp: int = 1,
    dp_shard: bool = False,
    checkpoint: str | None = None,
    deferred_batch_norm: bool = False,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    timeout: float | None = 300.0,
    routes: bool = True,
) -> DistributedPipe:
    """Split ``model`` over the ranks of ``group``: ``len(balance)`` stages x ``dp`` replicas.

    Call it on every rank (under torchrun) with the same arguments. Group rank ``g`` takes
    position ``g % pp`` of replica ``g // pp`` (``pp``: ranks per pipeline, ``len(balance)``,
    or ``len(balance) // 2`` for the virtual-stage schedules) and runs the stages the schedule
    places there. Each rank keeps and materializes only its own layers:
    build the model on the meta device so it never exists whole, and either let each layer's
    ``reset_parameters()`` initialise it (replica 0's weights are broadcast to the others) or
    pass ``state_dict`` (the whole model's, same keys as the plain model).

    Any other model (a transformers GPT-2, Llama or BERT, a ViT, ...) runs its own forward code
    on every rank, the rank's stage for real and the others in shadow on the meta device
    (:mod:`pipepar.program.ranks`); pass the same batch on every rank of a pipeline to
    ``step(**batch)``. It keeps only its stages' weights (weights tied across stages on each
    rank using them, their gradients summed). Every schedule, the virtual-stage ones too (a
    rank computes its stages in the schedule's order and hands values between them without
    communication); recompute unit by unit as in :func:`pipepar.wrap`.

    Args:
        model: an ``nn.Sequential`` or any ``nn.Module``, real or on the meta device (then
            with ``state_dict``).
        balance: layers (units, see :func:`pipepar.units`) per stage; its length is the number
            of stages.
        split: for other models, module paths where stages begin (instead of ``balance``).
        chunks: micro-batches per mini-batch (M).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``, ``"zb-v"`` or a
            :class:`~pipepar.core.schedule.Schedule`; for the last two, ``balance`` lists two
            stages per rank (``len(balance) // 2`` ranks per pipeline).
        dp: data-parallel replicas; the group must have ``pp * dp`` ranks (pp: ranks per
            pipeline).
        dp_shard: shard instead of replicate (an ``nn.Sequential`` only, ``dp >= 2``): the
            ``dp`` ranks of each pipeline position hold their stage's parameters, gradients
            and optimizer state in shards (``DTensor``, torch's FSDP2 layout), so each holds
            about ``1 / dp`` of them between steps. The weights are all-gathered once per
            step for all its micro-batches and the summed gradients reduce-scattered once
            (:mod:`pipepar.ranks.sharding`); results equal the replicated pipe's.
            ``parameters()`` are the shards: build the optimizer over them.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (recompute, non-reentrant;
            the default is ``"except_last"`` for an ``nn.Sequential`` and ``"never"`` for other
            models, which recompute unit by unit, as :func:`pipepar.wrap` does).
        deferred_batch_norm: batch norms track their running statistics over each replica's
            whole mini-batch, once per step (:mod:`pipepar.core.batchnorm`).
        device: this rank's device; default ``cuda:LOCAL_RANK`` on NCCL, else CPU.
        group: parent process group (default: the world); initialized from torchrun's
            environment if no process group exists yet.
        state_dict: weights to load into the local layers.
        timeout: seconds any wait for a peer may take, at ``wrap`` and in every step (a
            receive, a send, a collective). A rank that waits longer (its peer skipped a step,
            or is stuck in its own code) raises :class:`PipelineError` on every rank it can
            reach, naming itself, its stage, the action it is in, what it waits for and from
            whom, and the last action each other rank finished. ``None``: no limit of
            pipepar's (the process groups' default timeout still applies). Under NCCL the
            process groups' timeout ends a stall (waits there only order CUDA streams), after
            the rank logged where it stands.
        routes: for a model other than an ``nn.Sequential``: after the first call of a kind,
            each rank runs its own stage without per-operation interception and skips the
            other stages' units (see README, "Learned once, then free"). A model whose units
            run in an order that depends on the data (skipping a block for some inputs) ends
            the step with :class:`PipelineError` naming the change: pass ``False`` to run
            every call under the cut's mode.

    Raises:
        ValueError, TypeError: for inconsistent arguments, before any pipeline group exists.
            Ranks check each other's arguments (balance, chunks, schedule, dp, checkpoint,
            the model's layers, whether state_dict is given) through the c10d store, so one
            rank's bad or different arguments fail every rank with a ValueError naming the
            ranks and both values, instead of a hang.
        PipelineError: when a rank of the group does not call ``wrap`` within ``timeout``.

    Example:
        >>> pipe = wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
        >>> loss = pipe.step(x, y, nn.functional.cross_entropy)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Sequential) or split is not None:
        if dp_shard is not False:
            raise ValueError(
                f"dp_shard={dp_shard!r} shards the stages of an nn.Sequential split by balance "
                f"only, but the model is a {type(model).__name__}"
                f"{' split by module paths' if split is not None else ''}; pass dp_shard=False "
                "(replicas hold the whole stage), or wrap the model as an nn.Sequential"
            )
        return DistributedModelPipe(  # type: ignore[return-value]
            model,
            balance,
            split=split,
            chunks=chunks,
            schedule=schedule,
            dp=dp,
            device=device,
            group=group,
            state_dict=state_dict,
            timeout=timeout,
            routes=routes,
            checkpoint="never" if checkpoint is None else checkpoint,
            deferred_batch_norm=deferred_batch_norm,
        )
    return DistributedPipe(
        model,
        balance,  # type: ignore[arg-type]  # None is refused there, with the way out
        chunks=chunks,
        schedule=schedule,
        dp=dp,
        checkpoint="except_last" if checkpoint is None else checkpoint,
        device=device,
        group=group,
        state_dict=state_dict,
        timeout=timeout,
        deferred_batch_norm=deferred_batch_norm,
        dp_shard=dp_shard,
    )
