"""``pipepar.distributed.wrap``: any model becomes this rank's
:class:`~pipepar.distributed.pipe.DistributedPipe`, its layout given (``balance`` or ``split``)
or chosen on group rank 0 from a sample (``plan="auto"``) and built alike by every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.batching.rules import InputRule, OutputRule, Rules
from pipepar.core.compiled_units import CompileOption, compile_units, compiler_of, take_compiled
from pipepar.core.memory_budget import AUTO, auto_schedule, refuse_searched
from pipepar.core.schedule import Schedule
from pipepar.distributed.pipe import DistributedPipe
from pipepar.local.chain import is_chain
from pipepar.planner.auto_layout import (
    Given,
    capacity_bytes,
    choose_layout,
    given_schedule,
    keep_layout,
)
from pipepar.planner.cluster import cluster_for, device_memory
from pipepar.planner.layout import Layout
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.planner.split_points import torch_split, unit_order
from pipepar.planner.stage_activations import bytes_schedule
from pipepar.program.units import modules_of
from pipepar.ranks.process import ensure_process_group, resolve_device

__all__ = ["wrap"]


def wrap(
    model: nn.Module,
    balance: list[int] | None = None,
    *,
    split: Sequence[str] | None = None,
    split_spec: Mapping[str, Any] | None = None,
    plan: str | None = None,
    sample: Any = None,
    capacity: Any = None,
    chunks: int | None = None,
    schedule: str | Schedule | None = None,
    memory_budget: float | str | None = None,
    dp: int | None = None,
    dp_shard: bool | None = None,
    checkpoint: str | None = None,
    recompute: str = "in_place",
    deferred_batch_norm: bool = False,
    batch_coupling: str = "error",
    split_inputs: Mapping[str | int, InputRule] | None = None,
    join_outputs: Mapping[str, OutputRule] | None = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    timeout: float | None = 300.0,
    routes: bool = True,
    runtime: RuntimeFit | None = None,
    gc_every: int | None = None,
    compile: CompileOption = None,
    offload: bool | None = None,
) -> DistributedPipe:
    """Split ``model`` over the ranks of ``group``: ``len(balance)`` stages x ``dp`` replicas.

    Call it on every rank (under torchrun) with the same arguments. Group rank ``g`` takes
    position ``g % pp`` of replica ``g // pp`` (``pp``: ranks per pipeline, ``len(balance)``,
    or ``len(balance) // 2`` for the virtual-stage schedules) and runs the stages the schedule
    places there. Each rank keeps and materializes only its own layers:
    build the model on the meta device so it never exists whole, and either let each layer's
    ``reset_parameters()`` initialise it (replica 0's weights are broadcast to the others) or
    pass ``state_dict`` (the whole model's, same keys as the plain model).

    With ``plan="auto"`` (and no ``balance`` or ``split``) the layout is searched
    (:func:`pipepar.search_layouts`): the group's ranks are its devices, and ``pp x dp``, the
    schedule, ``chunks``, ``checkpoint`` and the balance are chosen for the fastest predicted
    step that fits ``capacity``; each of ``dp``, ``schedule``, ``chunks`` and ``checkpoint``
    given is fixed. Group rank 0 profiles ``sample`` (on its device, or on ``meta`` with FLOP
    counts for a model built on meta), searches, and broadcasts the layout, so every rank builds
    the same one; it is ``pipe.layout`` (None without ``plan``). ``sample`` is one step's
    global batch: ``G`` rows, of which each replica takes ``pipe.layout.rows = G / dp``;
    replica ``r`` (``pipe.dp_rank``) takes rows ``r * rows`` to ``(r + 1) * rows`` of each
    step's batch.

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
        split_spec: as torch.distributed.pipelining's ``pipeline()`` takes it, instead of
            ``split``: ``{"layers.4": SplitPoint.BEGINNING}`` (a stage begins at that
            module's first unit) or ``SplitPoint.END`` (at the unit after it). With none of
            ``balance``, ``split``, ``split_spec`` and ``plan``, ``pipe_split()`` calls in the
            forward split it where they stand, between two unit calls: every rank runs the
            forward once on ``sample`` as given (on ``meta`` for a model built there; the
            model and the random states left as they were) to find them. ``plan="auto"``
            searches the stages and does not look for them.
        plan: ``"auto"`` to choose the layout from ``sample`` (see above); ``None`` (the
            default) to use ``balance`` or ``split``.
        sample: with ``plan="auto"``: one step's global batch (a tensor, a tuple of positional
            arguments or a dict of keyword arguments), the same on every rank; without
            ``plan``, balance or split: an input to find the ``pipe_split()`` markers with.
            Given, the units are in the order the forward of ``sample`` calls them (as
            :func:`pipepar.units` with a sample lists them, and :func:`pipepar.wrap` lays them
            out), which ``balance`` counts and ``split`` names: a model that registers a
            module late and calls it early (BART's ``layernorm_embedding``, CLIP's vision
            tower) then has each stage's units in one stretch of the forward, as a stage
            across ranks must.
        capacity: with ``plan="auto"``: bytes per rank's device (int, ``"16GiB"``, or one per
            rank, of which the smallest); default: a CUDA device's memory, or this machine's
            memory shared among the ranks on it (``LOCAL_WORLD_SIZE``).
        chunks: micro-batches per mini-batch (M); ``None``: 1, or chosen with ``plan="auto"``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``, ``"zb-v"``,
            ``"v-half"``, ``"v-min"`` or a :class:`~pipepar.core.schedule.Schedule`; for the
            virtual-stage ones (from ``"interleaved-1f1b"`` on), ``balance`` lists two stages
            per rank (``len(balance) // 2`` ranks per pipeline). ``None``: ``"gpipe"``,
            or chosen with ``plan="auto"``. ``"auto"`` (with ``balance`` or ``split``): the
            fastest order found within ``memory_budget``, built alike on every rank for
            ``pp = group size // dp`` ranks per pipeline (with ``2 * pp`` stages a V or a
            loop may be chosen); with ``plan="auto"``: the search tries the named schedules
            and the order built for the capacity (``pipe.layout.order``), as
            :func:`pipepar.wrap` does.
        memory_budget: with ``schedule="auto"``, what each rank may hold of its stages'
            micro-batches at once, in the forms :func:`pipepar.wrap` takes (micro-batches,
            ``"50%"`` of 1F1B's, or bytes such as ``"2GiB"`` with ``sample``).
        dp: data-parallel replicas; the group must have ``pp * dp`` ranks (pp: ranks per
            pipeline). ``None``: 1, or chosen with ``plan="auto"``.
        dp_shard: shard instead of replicate (any model, ``dp >= 2``): the
            ``dp`` ranks of each pipeline position hold their stage's parameters, gradients
            and optimizer state in shards (``DTensor``, torch's FSDP2 layout), so each holds
            about ``1 / dp`` of them between steps. The weights are all-gathered once per
            step for all its micro-batches and the summed gradients reduce-scattered once
            (:mod:`pipepar.ranks.sharding`); results equal the replicated pipe's.
            ``parameters()`` are the shards: build the optimizer over them. ``None``:
            False, or chosen with ``plan="auto"`` (then True or False restricts the search).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (recompute, non-reentrant;
            the default is ``"except_last"`` for an ``nn.Sequential`` and ``"never"`` for other
            models, which recompute unit by unit, as :func:`pipepar.wrap` does); chosen with
            ``plan="auto"`` when None.
        recompute: ``"in_place"`` or ``"bubbles"``, as in :func:`pipepar.wrap`: the
            recomputes listed as ``R`` actions in each rank's idle time before the backward
            (every rank places them alike: on unit costs, then from the third training
            step on the stages' times measured in the second and shared by every rank; a
            model cut while it runs times its actions without their waits for messages);
            any model, as in one process.
        deferred_batch_norm: batch norms track their running statistics over each replica's
            whole mini-batch, once per step (:mod:`pipepar.core.batchnorm`).
        batch_coupling: ``"error"`` (default) or ``"per-micro-batch"``, as in
            :func:`pipepar.wrap`.
        split_inputs: how a call's arguments are cut into micro-batches, as in
            :func:`pipepar.wrap`.
        join_outputs: how the micro-batches' outputs are joined, as in :func:`pipepar.wrap`.
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
            other stages' units (the guide "Real models", "Learned once, then free"). A model
            whose units run in an order that depends on the data (skipping a block for some
            inputs) ends the step with :class:`PipelineError` naming the change: pass
            ``False`` to run every call under the cut's mode.
        runtime: with ``plan="auto"``: what the runtime adds to each action on these
            machines, fitted to steps you measured (:func:`pipepar.planner.fit_runtime`);
            group rank 0's is the one used. Default: the profile's times.
        gc_every: Python's cycle collector during ``pipe.step``: ``None`` (default) leaves it
            as it is; ``N`` turns it off while a step runs, collects what the step left after
            it, and runs a full collection every ``N`` steps (e.g. 100), the same step on
            every rank. A full pass pauses a rank (about 0.2 s in a process that imported
            transformers) and the whole pipeline waits for it; left to Python, each rank
            pauses at a step of its own, so the stalls add up with the ranks
            (:mod:`pipepar.core.garbage`).
        compile: compile each unit's ``forward`` as :func:`pipepar.wrap` does: True, or a dict
            of ``torch.compile``'s keyword arguments; a model or modules compiled before keep
            their options, moved onto the units (:mod:`pipepar.core.compiled_units`).
        offload: send what each micro-batch's forward saves for its backward to host memory
            while the stage runs other actions, and have it back one action before its
            backward, as the schedule's action lists say (:mod:`pipepar.core.offload_plan`;
            on CUDA through pinned memory on a side stream). The numbers are unchanged. With
            ``checkpoint`` unset nothing is recomputed. See the memory guide.
            Each rank offloads its own stages (ranks may differ). ``None``: chosen by the
            search with ``plan="auto"`` (only where a layout does not fit without it, and
            never on CPU devices, whose memory is the host's), else False. ``True``
            offloads on any device.

    Returns:
        This rank's :class:`~pipepar.distributed.pipe.DistributedPipe`: its stages' weights
        under the model's names, trained with ``pipe.step(...)`` on every rank.

    Raises:
        ValueError, TypeError: for inconsistent arguments, before any pipeline group exists;
            with ``plan="auto"``, an unknown ``plan``, no ``sample``, ``balance`` or ``split``
            given too, or no layout that fits (raised on every rank).
            Ranks check each other's arguments (balance, chunks, schedule, dp, checkpoint,
            the model's layers, whether state_dict is given) through the c10d store, so one
            rank's bad or different arguments fail every rank with a ValueError naming the
            ranks and both values, instead of a hang.
        PipelineError: when a rank of the group does not call ``wrap`` within ``timeout``.

    Example:
        >>> pipe = wrap(model, [4, 4], chunks=8, schedule="1f1b", dp=2)  # doctest: +SKIP
        >>> loss = pipe.step(x, y, nn.functional.cross_entropy)  # doctest: +SKIP
        >>> pipe = wrap(model, plan="auto", sample=x)  # doctest: +SKIP
        >>> rows = pipe.layout.rows  # doctest: +SKIP
        >>> mine = x[pipe.dp_rank * rows : (pipe.dp_rank + 1) * rows]  # doctest: +SKIP
    """
    if schedule == AUTO and plan is not None:
        refuse_searched(schedule, memory_budget)
    layout = None
    default_compiler = compiler_of(compile)
    model, compilers = take_compiled(model)
    chain = is_chain(model, split, sample)
    order = unit_order(model, sample, chain)
    if plan is None:
        split = (
            torch_split(model, balance, split, split_spec, sample, call_order=True, chain=chain)
            or split
        )
        _check_stages_given(balance, split, sample)
    else:
        if split_spec is not None:
            raise ValueError(
                f"plan={plan!r} chooses the stages but split_spec={dict(split_spec)!r} was "
                "given too; drop split_spec=... to let the search choose, or drop plan=..."
            )
        layout = _auto_layout(
            model, plan, balance, split, sample, capacity, chunks, schedule, dp, checkpoint,
            dp_shard, offload, device, group, runtime, Rules.given(split_inputs, join_outputs),
        )  # fmt: skip
        balance, chunks, dp = list(layout.balance), layout.chunks, layout.dp
        checkpoint, dp_shard, offload = layout.checkpoint, layout.dp_shard, layout.offload
        schedule = schedule if isinstance(schedule, Schedule) else layout.pipe_schedule
    dp_shard = False if dp_shard is None else dp_shard
    chunks = 1 if chunks is None else chunks
    schedule = "gpipe" if schedule is None else schedule
    dp = 1 if dp is None else dp
    schedule = _auto(model, schedule, memory_budget, balance, split, chunks, dp, group, sample,
                     checkpoint, chain)  # fmt: skip
    pipe = DistributedPipe(
        model,
        balance,
        split=split,
        chunks=chunks,
        schedule=schedule,
        dp=dp,
        checkpoint=checkpoint,
        recompute=recompute,
        device=device,
        group=group,
        state_dict=state_dict,
        timeout=timeout,
        routes=routes,
        deferred_batch_norm=deferred_batch_norm,
        batch_coupling=batch_coupling,
        split_inputs=split_inputs,
        join_outputs=join_outputs,
        dp_shard=dp_shard,
        gc_every=gc_every,
        offload=False if offload is None else offload,
        order=order,
    )
    keep_layout(pipe, layout)
    compile_units(modules_of(model, chain), compilers, default_compiler, model)
    return pipe


def _auto(
    model: nn.Module,
    schedule: str | Schedule,
    memory_budget: float | str | None,
    balance: list[int] | None,
    split: Sequence[str] | None,
    chunks: int,
    dp: int,
    group: dist.ProcessGroup | None,
    sample: Any,
    checkpoint: str | None,
    chain: bool,
) -> str | Schedule:
    """``schedule``, or for ``"auto"`` the schedule every rank builds alike for the budget."""
    if schedule != AUTO and memory_budget is None:
        return schedule
    ensure_process_group()
    stages = len(balance) if balance is not None else None if split is None else len(split) + 1

    workers = max(1, dist.get_world_size(group) // dp)
    built = auto_schedule(
        schedule,
        memory_budget,
        n_stages=stages,
        chunks=chunks,
        n_workers=workers,
        sized=lambda size: bytes_schedule(model, sample, balance, chunks, checkpoint,
                                          budget=size, n_workers=workers, chain=chain),
    )  # fmt: skip
    return "gpipe" if built is None else built


def _check_stages_given(balance: list[int] | None, split: object, sample: Any) -> None:
    """Without ``plan``, the stages come from ``balance``, ``split``, ``split_spec`` or the
    markers; else the ValueError with the fix."""
    if balance is None and split is None:
        found = " and the forward called no pipe_split() on sample" if sample is not None else ""
        raise ValueError(
            f"balance, split, split_spec and plan are None{found}; pass balance=[units per "
            "stage] (pipepar.units(model) lists the units), split=[module paths where stages "
            "begin], plan='auto' with sample=<one step's batch>, or sample=... with "
            "pipe_split() calls in the model's forward"
        )


def _auto_layout(
    model: nn.Module,
    plan: object,
    balance: list[int] | None,
    split: Sequence[str] | None,
    sample: Any,
    capacity: Any,
    chunks: int | None,
    schedule: str | Schedule | None,
    dp: int | None,
    checkpoint: str | None,
    dp_shard: bool | None,
    offload: bool | None,
    device: torch.device | str | None,
    group: dist.ProcessGroup | None,
    runtime: RuntimeFit | None,
    rules: Rules,
) -> Layout:
    """The layout every rank of ``group`` builds: chosen on group rank 0 and broadcast. The
    arguments are checked on every rank first, so a bad one fails each rank alike, before
    any communication; an error on rank 0 is broadcast too and raised on every rank."""
    _check_plan(plan, balance, split, sample)
    name, chunks = given_schedule(schedule, chunks)
    given = Given(
        schedule=name, chunks=chunks, checkpoint=checkpoint, dp=dp, dp_shard=dp_shard,
        offload=offload,
    )  # fmt: skip
    ensure_process_group()
    here = resolve_device(device, group)
    found: list[object] = [None]
    failed: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            found[0] = _search_here(model, sample, capacity, given, here, group, runtime, rules)
        except Exception as error:  # sent as text (it always pickles): every rank raises it
            failed, found[0] = error, (type(error).__name__, str(error))
    first = 0 if group is None else dist.get_global_rank(group, 0)  # torch 2.4 has no group_src
    dist.broadcast_object_list(found, src=first, group=group)
    chosen = found[0]
    if isinstance(chosen, Layout):
        return chosen
    if failed is not None:
        raise failed
    kind, message = chosen if isinstance(chosen, tuple) else ("RuntimeError", repr(chosen))
    error_type = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
    raise error_type(f"group rank 0, which chooses the layout for every rank, failed: {message}")


def _check_plan(
    plan: object, balance: list[int] | None, split: Sequence[str] | None, sample: Any
) -> None:
    """``plan="auto"`` with a sample and no balance or split; else the error with the fix."""
    if not isinstance(plan, str):
        raise TypeError(
            f"plan must be 'auto' or None, got {type(plan).__name__} {plan!r}; pass plan='auto' "
            "to choose the layout from sample, or plan=None with balance=[...]"
        )
    if plan != "auto":
        raise ValueError(
            f"plan={plan!r} is not known; pass plan='auto' to choose the layout from sample, "
            "or plan=None with balance=[...] or split=[...]"
        )
    for label, value in (("balance", balance), ("split", split)):
        if value is not None:
            raise ValueError(
                f"plan='auto' chooses the stages but {label}={list(value)!r} was given too; "
                f"drop {label}=... to let the search choose, or drop plan='auto' to use it"
            )
    if sample is None:
        raise ValueError(
            "plan='auto' needs sample=<one step's global batch> (a tensor, a tuple of "
            "positional arguments or a dict of keyword arguments) to profile the model; pass "
            "it on every rank, or pass balance=[...] instead of plan='auto'"
        )


def _search_here(
    model: nn.Module,
    sample: Any,
    capacity: Any,
    given: Given,
    here: torch.device,
    group: dist.ProcessGroup | None,
    runtime: RuntimeFit | None,
    rules: Rules,
) -> Layout:
    """The layout for the group's ranks, found on this rank: the model profiled on this
    rank's device, or on ``meta`` (times from FLOP counts) when it was built there."""
    size = dist.get_world_size(group)
    per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", size)), size)
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return choose_layout(
        model,
        sample,
        devices=size,
        given=given,
        cluster=cluster_for(here, size, per_node=per_node),
        capacity=capacity_bytes(capacity, size, device_memory(here, per_node)),
        profile_device="meta" if on_meta else str(here),
        runtime=runtime,
        rules=rules,
        ranks="chain" if is_chain(model, None, sample) else "program",  # posted receives
    )
