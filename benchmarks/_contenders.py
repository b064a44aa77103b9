"""One training step of each pipeline library, built the same way for every benchmark.

Single-process contenders (pipepar.wrap, torchgpipe.GPipe) are built in the calling process;
multi-process ones (pipepar.distributed, torch.distributed.pipelining) are built on every rank
of a :class:`benchmarks._procs.ProcessGroup` by :func:`stage_builder`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import pipepar
from benchmarks import _common as common

__all__ = ["DEFAULT_THREADS", "stage_builder", "threaded", "torch_pipelining"]

DEFAULT_THREADS = os.cpu_count() or 1  # torch's default math threads: one per core
Step = common.Step


def _train(module: nn.Module, work: common.Workload, devices: list[str]) -> Step:
    x, y = work.x.to(devices[0]), work.y.to(devices[-1])

    def backward() -> None:
        work.loss(module(x), y).backward()

    step = _optimized(module, backward)

    def synchronized() -> None:  # a no-op on the CPU
        step()
        common.synchronize(devices)

    return synchronized


def threaded(
    name: str,
    work: common.Workload,
    bal: list[int],
    m: int,
    defaults: bool,
    devices: list[str] | None = None,
) -> tuple[Step, Any]:
    """``(step, pipe)`` for ``"pipepar"`` or ``"torchgpipe"``: one thread per stage.

    ``defaults=False``: one math thread per CPU stage. ``defaults=True``: each library's own
    default (pipepar: the cores shared among the stages that compute at once on average;
    torchgpipe: torch's default count).
    ``devices``: one per stage, default the CPU for all.
    """
    model, devices = copy.deepcopy(work.model), devices or ["cpu"] * len(bal)
    if name == "pipepar":
        # Built and run as in a process that kept torch's default thread count.
        with _threads(DEFAULT_THREADS if defaults else torch.get_num_threads()):
            pipe: nn.Module = pipepar.wrap(
                model,
                bal,
                devices=devices,
                chunks=m,
                checkpoint="never",
                threads=None if defaults else 1,
            )
    else:
        from torchgpipe import GPipe

        pipe = GPipe(model, bal, devices=devices, chunks=m, checkpoint="never")
    step = _train(pipe, work, devices)
    return (_with_threads(step, DEFAULT_THREADS) if defaults else step), pipe


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    """``threads`` math threads here, and on the threads started meanwhile."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _with_threads(step: Step, threads: int) -> Step:
    def wrapped() -> None:
        with _threads(threads):
            step()

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
        inputs = (x,) if rank == 0 else ()
        targets: dict[str, Any] = {"target": y, "losses": []} if rank == world - 1 else {}
        runner.step(*inputs, **targets)

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
