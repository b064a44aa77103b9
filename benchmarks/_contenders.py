"""One training step of each pipeline library, built the same way for every benchmark.

Single-process contenders (pipepar.wrap, torchgpipe.GPipe) are built in the calling process;
multi-process ones (pipepar.distributed, torch.distributed.pipelining) are built on every rank
of a :class:`benchmarks._procs.ProcessGroup` by :func:`stage_builder`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import pipepar
from benchmarks import _common as common

__all__ = ["DEFAULT_THREADS", "stage_builder", "threaded", "torch_pipelining"]

DEFAULT_THREADS = os.cpu_count() or 1  # torch's default math threads: one per core
Step = common.Step


def _train(module: nn.Module, work: common.Workload) -> Step:
    def backward() -> None:
        out = module(work.x)
        work.loss(out, work.y.to(out.device)).backward()

    return _optimized(module, backward)


def threaded(
    name: str, work: common.Workload, bal: list[int], m: int, defaults: bool
) -> tuple[Step, Any]:
    """``(step, pipe)`` for ``"pipepar"`` or ``"torchgpipe"``: one thread per stage.

    ``defaults=False``: one math thread per stage. ``defaults=True``: each library's own default
    (pipepar: an equal share of the cores per stage; torchgpipe: torch's default count).
    """
    model, devices = copy.deepcopy(work.model), ["cpu"] * len(bal)
    if name == "pipepar":
        threads = None if defaults else 1
        pipe: nn.Module = pipepar.wrap(
            model, bal, devices=devices, chunks=m, checkpoint="never", threads=threads
        )
        return _train(pipe, work), pipe
    from torchgpipe import GPipe

    pipe = GPipe(model, bal, devices=devices, chunks=m, checkpoint="never")
    step = _train(pipe, work)
    return (_with_threads(step, DEFAULT_THREADS) if defaults else step), pipe


def _with_threads(step: Step, threads: int) -> Step:
    """Run ``step`` with ``threads`` math threads here and on the threads it starts."""

    def wrapped() -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            step()
        finally:
            torch.set_num_threads(previous)

    return wrapped


def torch_pipelining(
    part: nn.Module, rank: int, world: int, m: int, schedule: str, loss: common.Loss
) -> Callable[[Tensor, Tensor], None]:
    """``run(x, y)``: one torch.distributed.pipelining step of this rank's ``part``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = kind(stage, n_microbatches=m, loss_fn=loss)

    def run(x: Tensor, y: Tensor) -> None:
        if rank == 0:
            runner.step(x)
        elif rank == world - 1:
            runner.step(target=y, losses=[])
        else:
            runner.step()

    return run


def stage_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], Step]:
    """Factory run on every rank of a ProcessGroup: ``build(contender, m) -> step``."""
    work = common.workload(spec["workload"], quick=spec["quick"])
    bal: list[int] = spec["balance"]
    start = sum(bal[:rank])

    def build(contender: str, m: int) -> Step:
        schedule = contender.rsplit(" ", 1)[1]
        if contender.startswith("torch"):
            part = nn.Sequential(*list(copy.deepcopy(work.model))[start : start + bal[rank]])
            run = torch_pipelining(part, rank, world, m, schedule, work.loss)
            return _optimized(part, lambda: run(work.x, work.y))
        import pipepar.distributed as ppd

        pipe = ppd.wrap(
            copy.deepcopy(work.model), bal, chunks=m, schedule=schedule, checkpoint="never"
        )
        return _optimized(pipe, lambda: pipe.step(work.x, work.y, work.loss))

    return build


def _optimized(module: nn.Module, backward: Callable[[], None]) -> Step:
    """``backward()`` then an SGD step on ``module``'s parameters, gradients set to None."""
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> None:
        backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
