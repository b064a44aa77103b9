"""Measure a stage's real peak memory over one training step, to check a plan against reality.

:func:`measure_stage` runs one stage's actions for one mini-batch with the pipeline's own step
(:class:`pipepar.core.step.StageStep`), in the order the schedule gives that stage
(:func:`pipepar.core.schedule.make`): forwards that keep the input and, unless checkpointed, the
graph; backwards (recomputing checkpointed micro-batches, or only the input gradient when the
schedule defers W); weight gradients summed across micro-batches; then the gradients go to
``.grad`` and the optimizer steps.

The peak is read from the allocator, independently of the profiler's bookkeeping: on CUDA with
``torch.cuda.max_memory_allocated``, on CPU by replaying the allocation events that
``torch.profiler`` records with ``profile_memory=True``.

    >>> stage = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    >>> peak = measure_stage(stage, torch.randn(32, 64), chunks=4, optimizer="adam")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pipepar.core.schedule import VIRTUAL, Action, Schedule, make
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep
from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.optimizer_state import resolve_optimizer

__all__ = ["measure_split", "measure_stage", "stage_order"]


def stage_order(schedule: str, chunks: int, stages: int, j: int) -> list[tuple[str, int]]:
    """The (action, micro-batch) list stage ``j`` of ``stages`` runs for one mini-batch.

    Example:
        >>> stage_order("1f1b", 3, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    return [(a.kind, a.microbatch) for a in _schedule(schedule, stages, chunks).stage(j)]


def _schedule(schedule: str | Schedule, stages: int, chunks: int) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
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
        schedule: a schedule name (see :data:`pipepar.core.schedule.NAMES`) or a Schedule.
        stage: the stage's index j (the 1F1B warm-up depends on it).
        stages: the number of stages K.

    Returns:
        Parameters + optimizer state (+ the batch for stage 0) + the largest rise in allocated
        bytes during the step.

    Example:
        >>> measure_stage(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), optimizer=None) > 0
        True
    """
    first = next(layers.parameters(), None)
    device = first.device if first is not None else batch.device
    spec = resolve_optimizer(optimizer)
    params = [p for p in layers.parameters() if p.requires_grad]
    opt = spec.cls(params, **spec.kwargs) if spec.cls is not None and params else None
    batch = batch.to(device)

    plan = _schedule(schedule, stages, chunks)

    def step() -> None:
        _train_step(layers, batch, opt, checkpoint, plan, Stage(stage, 0, list(layers), device))

    step()  # warm-up: creates the optimizer state, as in any step after the first
    resident = _storage_bytes(list(layers.parameters()) + list(layers.buffers()))
    if opt is not None:
        resident += _storage_bytes(_state_tensors(opt, device))
    if stage == 0:
        resident += batch.numel() * batch.element_size()
    with _allocation_rise(device) as rise:
        step()
    return resident + rise()


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
    peaks, start, x = [], 0, batch
    for j, n in enumerate(balance):
        layers = model[start : start + n]
        peak = measure_stage(
            layers,
            x,
            chunks=chunks,
            optimizer=optimizer,
            checkpoint=checkpoint,
            schedule=schedule,
            stage=j,
            stages=len(balance),
        )
        peaks.append(peak)
        with torch.no_grad():
            x = layers(x)
        start += n
    return peaks


def _train_step(
    layers: nn.Sequential,
    batch: torch.Tensor,
    opt: torch.optim.Optimizer | None,
    checkpoint: str,
    schedule: Schedule,
    stage: Stage,
) -> None:
    m = schedule.n_microbatches
    step = StageStep(
        stage,
        m,
        checkpoint=checkpoint,
        grad=True,
        input_grad=stage.index > 0,
        split=functools.partial(schedule.splits_backward, stage.index),
    )
    sizes = [len(c) for c in batch.chunk(m)]
    shapes: dict[int, torch.Size] = {}
    for action in schedule.stage(stage.index):
        _act(step, action, batch, sizes, shapes)
    for p, g in zip(step.params, step.param_grads()):
        p.grad = g
    step.release()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p in step.params:
        p.grad = None


def _act(
    step: StageStep,
    action: Action,
    batch: torch.Tensor,
    sizes: list[int],
    shapes: dict[int, torch.Size],
) -> None:
    i = action.microbatch
    if action.kind == "F":
        if step.stage.index == 0:
            x = batch.narrow(0, sum(sizes[:i]), sizes[i])  # a view of the resident batch
        else:  # a fresh tensor, as received from the previous stage
            x = torch.randn((sizes[i], *batch.shape[1:]), dtype=batch.dtype, device=batch.device)
        shapes[i] = step.forward(i, x).shape  # type: ignore[union-attr]
    elif action.kind == "B":
        grad = torch.ones(shapes.pop(i), dtype=batch.dtype, device=batch.device)  # from j+1
        step.backward(i, (grad,))
    else:
        step.weight(i)


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
