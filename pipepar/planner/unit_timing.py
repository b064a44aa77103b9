"""How long each unit of any model takes on a real device, forward and backward.

The units are timed over the pass :mod:`pipepar.planner.unit_trace` traces: the model's own
``forward`` cut at every unit, then the units' backwards one at a time in reverse
(:func:`~pipepar.planner.unit_trace.unit_forward`,
:func:`~pipepar.planner.unit_trace.unit_backward`), here with no tracker or hook beyond a clock.
A unit's forward time runs from its start to the next unit's (the code between two units counts
with the one before); its backward time is that of its own backward. On CUDA the device is
synchronised at every boundary, so a unit is charged for the kernels it launched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pipepar.meta.values import meta_modes
from pipepar.planner.unit_trace import UnitCall, unit_backward, unit_forward

__all__ = ["time_units"]


def time_units(call: UnitCall, *, repeats: int = 3) -> list[tuple[float, float]]:
    """Wall-clock (forward_ms, backward_ms) per unit on a real device: the median of
    ``repeats`` untraced passes after one that warms up (a first call pays for lazy
    initialisation, and would make the first unit look several times its cost); forward time
    runs from a unit's start to the next unit's, code between them included."""
    _time_once(call)
    passes = [_time_once(call) for _ in range(max(1, repeats))]
    return [
        (statistics.median(p[i][0] for p in passes), statistics.median(p[i][1] for p in passes))
        for i in range(len(call.units))
    ]


def _time_once(call: UnitCall) -> list[tuple[float, float]]:
    sync = (lambda: torch.cuda.synchronize(call.device)) if call.device.type == "cuda" else None
    n = len(call.units)
    forward, backward = [0.0] * n, [0.0] * n
    clock: list[Any] = [None, 0.0]  # the unit computing, since when

    def enter(i: int) -> None:
        if sync is not None:
            sync()
        now = time.perf_counter()
        if clock[0] is not None:
            forward[clock[0]] += (now - clock[1]) * 1e3
        clock[:] = [i, now]

    with meta_modes(call.device, call.values):
        graphs, seeds, output = unit_forward(call, enter)
    enter(clock[0])  # close the last window
    del output

    def step(
        i: int, outs: list[Tensor], grads: list[Tensor], ins: list[Tensor], weights: list[Tensor]
    ) -> Sequence[Any]:
        start = time.perf_counter()
        result = torch.autograd.grad(outs, ins + weights, grads, allow_unused=True)
        if sync is not None:
            sync()
        backward[i] = (time.perf_counter() - start) * 1e3
        return result[: len(ins)]

    unit_backward(graphs, seeds, step)
    return list(zip(forward, backward))
