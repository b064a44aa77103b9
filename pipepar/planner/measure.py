"""Measure a stage's real peak memory over one training step, to check a plan against reality.

:func:`measure_stage` runs one stage's actions for one mini-batch with the pipeline's own step
(:class:`pipepar.core.step.StageStep`), in the order the schedule gives that stage
(:func:`pipepar.core.named_schedules.make`): forwards that keep the input and, unless
checkpointed, the graph; backwards (recomputing checkpointed micro-batches, or only the input
gradient when the schedule defers W); weight gradients summed across micro-batches; then the
gradients go to ``.grad`` and the optimizer steps.

:func:`measure_device` does the same for all stages placed on one device (two with the
virtual-stage schedules interleaved 1F1B and ZB-V), running their actions interleaved in that
device's order of the schedule, one optimizer over all their parameters.

The peak is read from the allocator, independently of the profiler's bookkeeping: on CUDA with
``torch.cuda.max_memory_allocated``, on CPU by replaying the allocation events that
``torch.profiler`` records with ``profile_memory=True``.

    >>> stage = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    >>> peak = measure_stage(stage, torch.randn(32, 64), chunks=4, optimizer="adam")
    >>> model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    >>> peak = measure_device(model, torch.randn(32, 64), [1, 1, 1, 1], device=0, chunks=4,
    ...                       schedule="zb-v")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.offload_plan import offloader_for
from pipepar.core.recompute_placement import without_rebuilds
from pipepar.core.schedule import Action, Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep
from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.optimizer_state import resolve_optimizer

__all__ = ["measure_device", "measure_split", "measure_stage", "stage_order"]


def stage_order(schedule: str, chunks: int, stages: int, j: int) -> list[tuple[str, int]]:
    """The (action, micro-batch) list stage ``j`` of ``stages`` runs for one mini-batch.

    Example:
        >>> stage_order("1f1b", 3, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    return [(a.kind, a.microbatch) for a in _schedule(schedule, stages, chunks).stage(j)]


def _schedule(schedule: str | Schedule, stages: int, chunks: int) -> Schedule:
    if isinstance(schedule, Schedule):
        return without_rebuilds(schedule, "measuring a stage")
    workers = stages // 2 if schedule in VIRTUAL else stages
    return make(schedule, stages, chunks, n_workers=max(1, workers))


def measure_stage(
    layers: nn.Sequential,
    batch: torch.Tensor,
    *,
    chunks: int = 1,
    optimizer: object = "adam",
    checkpoint: str = "never",
    schedule: str | Schedule = "gpipe",
    stage: int = 0,
    stages: int = 1,
) -> int:
    """Peak bytes on the stage's device during one training step (after a warm-up step).

    Args:
        layers: the stage's layers, on the device to measure ("cpu" or a CUDA device).
        batch: the stage's whole input batch; stage 0 keeps it resident, later stages receive
            one micro-batch at a time (fresh tensors that require grad, as from a transfer).
        chunks: micro-batches M.
        optimizer: as for :func:`pipepar.profile`.
        checkpoint: "always", "except_last" or "never".
        schedule: a schedule name (see :data:`pipepar.core.named_schedules.NAMES`) or a Schedule.
        stage: the stage's index j (the 1F1B warm-up depends on it).
        stages: the number of stages K.

    Returns:
        Parameters + optimizer state (+ the batch for stage 0) + the largest rise in allocated
        bytes during the step.

    Example:
        >>> measure_stage(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), optimizer=None) > 0
        True
    """
    plan = _schedule(schedule, stages, chunks)
    return _measure({stage: (layers, batch)}, plan.stage(stage), plan, optimizer, checkpoint)


def measure_device(
    model: nn.Sequential,
    batch: torch.Tensor,
    balance: Sequence[int],
    *,
    device: int,
    chunks: int = 1,
    optimizer: object = "adam",
    checkpoint: str = "never",
    schedule: str | Schedule = "gpipe",
    offload: bool = False,
) -> int:
    """Peak bytes of one device during one training step (after a warm-up step): all stages
    the schedule places on it, their actions interleaved in the device's own order.

    A stage whose previous stage is on the same device takes that stage's forward outputs as
    inputs, and hands it its input gradients, as the runtime does; other stages receive fresh
    tensors, as in :func:`measure_stage`.

    Args:
        model: the whole model; its layers stay where they are (the device's stages' layers on
            the device to measure).
        batch: the model's input batch (stage 0 keeps it resident).
        balance: layers per stage, one entry per stage of the schedule (``2 * devices`` for
            interleaved 1F1B and ZB-V).
        device: the device (worker) to measure, ``0 .. devices - 1``.
        chunks: micro-batches M.
        optimizer: as for :func:`pipepar.profile`.
        checkpoint: "always", "except_last" or "never".
        schedule: a schedule name (see :data:`pipepar.core.named_schedules.NAMES`) or a
            Schedule over ``len(balance)`` stages.
        offload: send saved activations to host memory as ``pipepar.wrap(..., offload=True)``
            does (on the CPU, into memory torch's allocator does not count).

    Returns:
        Parameters + optimizer state of the device's stages (+ the batch if stage 0 is there)
        + the largest rise in allocated bytes during the step.

    Raises:
        ValueError: ``device`` is not a device of the schedule, or ``balance`` does not give
            one entry per stage.

    Example:
        >>> model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        >>> measure_device(model, torch.randn(4, 8), [1, 1, 1, 1], device=1, chunks=2,
        ...                schedule="zb-v") > 0
        True
    """
    plan = _schedule(schedule, len(balance), chunks)
    if plan.n_stages != len(balance):
        raise ValueError(
            f"balance has {len(balance)} entries but schedule {plan.name!r} has "
            f"{plan.n_stages} stages; give one entry per stage"
        )
    if not 0 <= device < plan.n_workers:
        raise ValueError(
            f"device={device} is out of range: schedule {plan.name!r} runs on {plan.n_workers} "
            f"devices, 0..{plan.n_workers - 1}"
        )
    mine = set(plan.stages_of(device))
    parts = {j: part for j, part in enumerate(_stage_inputs(model, batch, balance)) if j in mine}
    return _measure(parts, plan.worker(device), plan, optimizer, checkpoint, offload)


def measure_split(
    model: nn.Sequential,
    batch: torch.Tensor,
    balance: list[int],
    *,
    chunks: int = 1,
    optimizer: object = "adam",
    checkpoint: str = "never",
    schedule: str | Schedule = "gpipe",
) -> list[int]:
    """:func:`measure_stage` for every stage of ``model`` split by ``balance``.

    Each stage's input batch is the previous stage's output on ``batch`` (computed without
    gradients after that stage was measured); the layers stay on their devices.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        >>> len(measure_split(model, torch.randn(4, 8), [2, 1], chunks=2))
        2
    """
    return [
        measure_stage(
            layers,
            x,
            chunks=chunks,
            optimizer=optimizer,
            checkpoint=checkpoint,
            schedule=schedule,
            stage=j,
            stages=len(balance),
        )
        for j, (layers, x) in enumerate(_stage_inputs(model, batch, balance))
    ]


def _stage_inputs(
    model: nn.Sequential, batch: torch.Tensor, balance: Sequence[int]
) -> Iterator[tuple[nn.Sequential, torch.Tensor]]:
    """Each stage's layers and whole input batch: the previous stage's output on ``batch``,
    computed without gradients once the caller is done with the previous stage."""
    start, x = 0, batch
    for n in balance:
        layers = model[start : start + n]
        yield layers, x
        with torch.no_grad():
            x = layers(x)
        start += n


def _measure(
    stages: dict[int, tuple[nn.Sequential, torch.Tensor]],
    actions: Sequence[Action],
    schedule: Schedule,
    optimizer: object,
    checkpoint: str,
    offload: bool = False,
) -> int:
    """Resident bytes + the largest allocation rise of one step (after a warm-up step) of
    ``stages`` (index -> layers, whole input batch) running ``actions`` in order."""
    layers = nn.ModuleList([module for part, _ in stages.values() for module in part])
    sample = next(iter(stages.values()))[1]
    first = next(layers.parameters(), None)
    device = first.device if first is not None else sample.device
    spec = resolve_optimizer(optimizer)
    params = [p for p in layers.parameters() if p.requires_grad]
    opt = spec.cls(params, **spec.kwargs) if spec.cls is not None and params else None
    inputs = {j: (part, x.to(device)) for j, (part, x) in stages.items()}

    def step() -> None:
        _train_step(inputs, actions, schedule, opt, checkpoint, device, offload)

    step()  # warm-up: creates the optimizer state, as in any step after the first
    resident = _storage_bytes(list(layers.parameters()) + list(layers.buffers()))
    if opt is not None:
        resident += _storage_bytes(_state_tensors(opt, device))
    if 0 in inputs:
        resident += inputs[0][1].numel() * inputs[0][1].element_size()
    with _allocation_rise(device) as rise:
        step()
    return resident + rise()


@dataclass
class _Part:
    """One stage within a measured step: its step, whole input batch and micro-batch sizes,
    and the outputs (shape, dtype) its backwards will get gradients for."""

    step: StageStep
    batch: torch.Tensor
    sizes: list[int]
    outputs: dict[int, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)


def _train_step(
    stages: dict[int, tuple[nn.Sequential, torch.Tensor]],
    actions: Sequence[Action],
    schedule: Schedule,
    opt: torch.optim.Optimizer | None,
    checkpoint: str,
    device: torch.device,
    offload: bool,
) -> None:
    m = schedule.n_microbatches
    parts = {
        j: _Part(_stage_step(j, layers, schedule, checkpoint, device), x, _sizes(x, m))
        for j, (layers, x) in stages.items()
    }
    offloader = offloader_for(offload, schedule, [part.step.stage for part in parts.values()])
    for part in parts.values():
        part.step.offload = offloader
    sent: dict[Action, torch.Tensor] = {}  # from one stage of the device to another
    for action in actions:
        _act(parts, action, sent)
    for part in parts.values():
        for p, g in zip(part.step.params, part.step.param_grads()):
            p.grad = g
        part.step.release()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for part in parts.values():
        for p in part.step.params:
            p.grad = None


def _stage_step(
    j: int, layers: nn.Sequential, schedule: Schedule, checkpoint: str, device: torch.device
) -> StageStep:
    return StageStep(
        Stage(j, 0, list(layers), device),
        schedule.n_microbatches,
        checkpoint=checkpoint,
        grad=True,
        input_grad=j > 0,
        split=functools.partial(schedule.splits_backward, j),
    )


def _sizes(batch: torch.Tensor, m: int) -> list[int]:
    return [len(c) for c in batch.chunk(m)]


def _act(parts: dict[int, _Part], action: Action, sent: dict[Action, torch.Tensor]) -> None:
    """Run ``action``; a forward's output or a backward's input gradient is kept in ``sent``
    (keyed by the action that takes it) when the stage it goes to is measured too."""
    j, i = action.stage, action.microbatch
    part = parts[j]
    if action.kind == "F":
        x = sent.pop(action, None)
        y = part.step.forward(i, x if x is not None else _received(part, j, i))
        part.outputs[i] = (y.shape, y.dtype)  # type: ignore[union-attr]
        if j + 1 in parts:
            sent[Action(j + 1, "F", i)] = y  # type: ignore[assignment]
    elif action.kind == "B":
        shape, dtype = part.outputs.pop(i)
        grad = sent.pop(action, None)
        if grad is None:  # a fresh tensor, as received from stage j+1
            grad = torch.ones(shape, dtype=dtype, device=part.batch.device)
        dx = part.step.backward(i, (grad,))
        if j - 1 in parts and dx and dx[0] is not None:
            sent[Action(j - 1, "B", i)] = dx[0]
    else:
        part.step.weight(i)


def _received(part: _Part, j: int, i: int) -> torch.Tensor:
    """Stage ``j``'s input for micro-batch ``i`` from outside the device."""
    sizes, batch = part.sizes, part.batch
    if j == 0:
        return batch.narrow(0, sum(sizes[:i]), sizes[i])  # a view of the resident batch
    # a fresh tensor, as received from the previous stage
    return torch.randn((sizes[i], *batch.shape[1:]), dtype=batch.dtype, device=batch.device)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(opt: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    return [
        v
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.device == device
    ]


@contextlib.contextmanager
def _allocation_rise(device: torch.device) -> Iterator[Callable[[], int]]:
    """Yield a function giving the largest rise in allocated bytes inside the block."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield lambda: int(torch.cuda.max_memory_allocated(device) - start)
        return
    with AllocatorLog() as log:
        yield lambda: log.largest_rise
