"""Measure a stage's real peak memory over one training step, to check a plan against reality.

:func:`measure_stage` runs one stage's actions for one mini-batch the way the engine does
(``pipepar.engine``): per micro-batch a forward that keeps the input and, unless checkpointed,
the output; per micro-batch a backward (recomputing checkpointed ones) with
``torch.autograd.grad`` whose parameter gradients are summed across micro-batches; then the
gradients go to ``.grad`` and the optimizer steps. The order is GPipe's (all forwards, then the
backwards last to first) or 1F1B's (warm-up forwards, alternating, cool-down backwards).

The peak is read from the allocator, independently of the profiler's bookkeeping: on CUDA with
``torch.cuda.max_memory_allocated``, on CPU by replaying the allocation events that
``torch.profiler`` records with ``profile_memory=True``.

    >>> stage = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    >>> peak = measure_stage(stage, torch.randn(32, 64), chunks=4, optimizer="adam")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.optimizer_state import resolve_optimizer

__all__ = ["measure_split", "measure_stage", "stage_order"]


def stage_order(schedule: str, chunks: int, stages: int, j: int) -> list[tuple[str, int]]:
    """The (action, micro-batch) list stage ``j`` of ``stages`` runs for one mini-batch.

    Example:
        >>> stage_order("1f1b", 3, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if schedule == "gpipe":
        return [("F", i) for i in range(chunks)] + [("B", i) for i in reversed(range(chunks))]
    warmup = min(stages - j - 1, chunks)
    order = [("F", i) for i in range(warmup)]
    for i in range(chunks - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(chunks - warmup, chunks)]


def measure_stage(
    layers: nn.Sequential,
    batch: torch.Tensor,
    *,
    chunks: int = 1,
    optimizer: object = "adam",
    checkpoint: str = "never",
    schedule: str = "gpipe",
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
        schedule: "gpipe" or "1f1b".
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

    def step() -> None:
        _train_step(
            layers,
            batch,
            opt,
            chunks,
            checkpoint,
            stage_order(schedule, chunks, stages, stage),
            stage,
        )

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
    schedule: str = "gpipe",
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
    chunks: int,
    checkpoint: str,
    order: list[tuple[str, int]],
    stage: int,
) -> None:
    params = [p for p in layers.parameters() if p.requires_grad]
    sizes = [len(c) for c in batch.chunk(chunks)]
    records: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    sums: list[torch.Tensor | None] = [None] * len(params)
    owned = [False] * len(params)
    for action, i in order:
        if action == "F":
            records[i] = _forward(layers, batch, sizes, i, stage, checkpoint, chunks)
        else:
            x, y = records.pop(i)
            if y is None:
                with torch.enable_grad():
                    y = layers(x)  # recompute the checkpointed micro-batch
            grad_out = torch.ones_like(y)  # arrives from the next stage
            inputs = [x] if x.requires_grad else []
            grads = torch.autograd.grad([y], [*inputs, *params], [grad_out], allow_unused=True)
            _accumulate(sums, owned, grads[len(inputs) :])
            del x, y, grad_out, inputs, grads  # the engine drops them when backward returns
    for p, g in zip(params, sums):
        p.grad = g
    del sums
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def _forward(
    layers: nn.Sequential,
    batch: torch.Tensor,
    sizes: list[int],
    i: int,
    stage: int,
    checkpoint: str,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if stage == 0:
        x = batch.narrow(0, sum(sizes[:i]), sizes[i])  # a view of the resident batch
    else:
        shape = (sizes[i], *batch.shape[1:])
        x = torch.randn(shape, dtype=batch.dtype, device=batch.device, requires_grad=True)
    skip = checkpoint == "always" or (checkpoint == "except_last" and i < chunks - 1)
    with torch.set_grad_enabled(not skip):
        y = layers(x)
    return x, (None if skip else y)


def _accumulate(sums: list[Any], owned: list[bool], grads: tuple[Any, ...]) -> None:
    # The engine's sum at its most expensive: alias the first gradient, add out of place once,
    # then in place (the engine adds in place from the start when a gradient owns its storage,
    # so this and the planner's model, which follows it, are upper bounds).
    for k, g in enumerate(grads):
        if g is None:
            continue
        if sums[k] is None:
            sums[k] = g
        elif owned[k]:
            sums[k].add_(g)
        else:
            sums[k], owned[k] = sums[k] + g, True


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
