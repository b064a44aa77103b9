"""One training step of each pipeline library, built the same way for every benchmark.

Single-process contenders (pipepar.wrap, torchgpipe.GPipe) are built in the calling process;
multi-process ones (pipepar.distributed, torch.distributed.pipelining) are built on every rank
of a :class:`benchmarks._procs.ProcessGroup` by :func:`stage_builder`.

For ``bench_schedules.py`` (every schedule of every library, forward + backward only, no
optimizer): :func:`one_process` builds the in-process contenders, :func:`schedule_builder` the
multi-process ones, and :func:`torch_schedule` any torch.distributed.pipelining schedule.
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
from pipepar.core import switches
from pipepar.local.thread_choice import TRIALS, WARMUP

__all__ = [
    "DEFAULT_THREADS",
    "SETTLE",
    "TORCH_SCHEDULES",
    "even_balance",
    "one_process",
    "schedule_builder",
    "stage_builder",
    "threaded",
    "torch_pipelining",
    "torch_schedule",
]

DEFAULT_THREADS = os.cpu_count() or 1  # torch's default math threads: one per core
SETTLE = WARMUP + 2 * TRIALS
"""Steps a one-process pipepar contender runs before it is timed: its choice between its
workers and the calling thread is made by then (:mod:`pipepar.local.thread_choice`)."""
#: torch.distributed.pipelining's schedules, by their class name without ``Schedule``.
TORCH_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: The V-shaped ones: rank r holds stages r and 2K-1-r (rank 0 the first and the last).
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
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


def _optimized(module: nn.Module, backward: Callable[[], Any]) -> Step:
    """``backward()`` then an SGD step on ``module``'s parameters, gradients set to None."""
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> None:
        backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# -- every schedule, forward + backward only (bench_schedules.py) ------------------------------
def even_balance(n_layers: int, n_stages: int) -> list[int]:
    """``n_stages`` equal stages of ``n_layers`` layers (the benchmark model is uniform)."""
    if n_layers % n_stages:
        raise ValueError(
            f"{n_layers} layers do not split into {n_stages} equal stages; use a model with a "
            f"multiple of {n_stages} layers"
        )
    return [n_layers // n_stages] * n_stages


def pipepar_balance(schedule: str, n_layers: int, workers: int) -> list[int]:
    """One stage per worker, or two for pipepar's virtual-stage schedules."""
    from pipepar.core.named_schedules import VIRTUAL

    return even_balance(n_layers, workers * (2 if schedule in VIRTUAL else 1))


def one_process(
    library: str, schedule: str, work: common.Workload, m: int, workers: int = 2
) -> tuple[Step, nn.Module]:
    """``(step, pipe)`` of ``"pipepar"`` (``pipe.step``; its actions on the workers or on this
    thread, whichever its first calls timed faster), ``"pipepar-workers"`` (the same on the
    workers always), ``"pipepar-call"`` (``pipe(x)`` and ``loss.backward()``), ``"torchgpipe"``
    (the same): one math thread per stage; or ``"hand-serial"``: the hand-written pipeline's
    actions on this thread, no messages. A pipepar pipe has made its choice (:data:`SETTLE`
    steps run)."""
    model, n = copy.deepcopy(work.model), len(work.model)
    if library in ("pipepar", "pipepar-call", "pipepar-workers"):
        run_on = "workers" if library == "pipepar-workers" else switches.run_on()
        with _switch("PIPEPAR_RUN_ON", run_on):  # read when the pipe is made
            pipe = pipepar.wrap(
                model,
                pipepar_balance(schedule, n, workers),
                devices=["cpu"] * workers,
                chunks=m,
                schedule=schedule,
                checkpoint="never",
                threads=1,
            )
        if library == "pipepar-call":
            step = _zeroed(pipe, lambda: work.loss(pipe(work.x), work.y).backward())
        else:
            step = _zeroed(pipe, lambda: pipe.step(work.x, work.y, work.loss))
        for _ in range(SETTLE):  # the pipe times its workers against this thread first
            step()
        return step, pipe
    if library in ("hand-serial", "hand-serial-read"):
        from benchmarks import _hand_pipeline as hand

        weights = "terms-read" if library == "hand-serial-read" else "terms"
        run, part = hand.hand_written(
            model, schedule, 0, workers, m, work.loss, weights, serial=True
        )
        hand.check_gradients(run, part, model, work.x, work.y, work.loss)
        return _zeroed(part, lambda: run(work.x, work.y)), part
    if library != "torchgpipe":
        raise ValueError(
            f"library {library!r} is not pipepar, pipepar-workers, pipepar-call, hand-serial or "
            "torchgpipe"
        )
    from torchgpipe import GPipe

    gpipe = GPipe(
        model, even_balance(n, workers), devices=["cpu"] * workers, chunks=m, checkpoint="never"
    )
    return _zeroed(gpipe, lambda: work.loss(gpipe(work.x), work.y).backward()), gpipe


def torch_schedule(
    model: nn.Sequential, name: str, rank: int, world: int, m: int, loss: common.Loss
) -> tuple[Callable[[Tensor, Tensor], None], nn.Module]:
    """``(run(x, y), local layers)``: torch.distributed.pipelining's ``Schedule<name>`` on this
    rank. Single-stage schedules get ``world`` equal stages, one per rank; the multi-stage ones
    ``2 * world``, looped (rank r: r, r + world) or V-shaped (rank r: r, 2 * world - 1 - r)."""
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    kind = getattr(tp, f"Schedule{name}", None)
    if kind is None:
        raise ValueError(f"torch has no Schedule{name}; pass one of {list(TORCH_SCHEDULES)}")
    multi = issubclass(kind, PipelineScheduleMulti)
    n = world * (2 if multi else 1)
    bal, layers = even_balance(len(model), n), list(model)
    style = "v" if name in _V_SHAPED else "loop"
    mine = generate_rank_to_stage_mapping(world, n, style)[rank]
    parts = [nn.Sequential(*layers[sum(bal[:i]) : sum(bal[: i + 1])]) for i in mine]
    stages = [tp.PipelineStage(p, i, n, torch.device("cpu")) for p, i in zip(parts, mine)]
    runner = kind(stages if multi else stages[0], n_microbatches=m, loss_fn=loss)
    first, last = 0 in mine, n - 1 in mine  # who feeds the input, who gets the target

    def run(x: Tensor, y: Tensor) -> None:
        targets: dict[str, Any] = {"target": y, "losses": []} if last else {}
        runner.step(*((x,) if first else ()), **targets)

    return run, nn.ModuleList(parts)


def schedule_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], Step]:
    """Factory run on every rank of a ProcessGroup: ``build("library:schedule", m) -> step``
    for ``"limit:"`` (this rank alone runs the one-core job), ``"pipepar.distributed:<name>"``
    and ``"torch:<Schedule name without 'Schedule'>"``. Every rank gets pipepar's malloc
    thresholds, as the benchmark's own process does, so all run on the same allocator."""
    from pipepar.local import cpu_malloc

    cpu_malloc.tune()
    work = common.workload(spec["workload"], quick=spec["quick"], width=spec.get("width"))

    def build(contender: str, m: int) -> Step:
        library, _, schedule = contender.partition(":")
        model = copy.deepcopy(work.model)
        if library == "limit":
            return common.accumulation_step(work, m, optimizer=False)
        if library == "torch":
            run, part = torch_schedule(model, schedule, rank, world, m, work.loss)
            return _zeroed(part, lambda: run(work.x, work.y))
        if library in ("hand", "hand-autograd"):
            from benchmarks import _hand_pipeline as hand

            weights = "autograd" if library == "hand-autograd" else "terms"
            run, part = hand.hand_written(model, schedule, rank, world, m, work.loss, weights)
            hand.check_gradients(run, part, model, work.x, work.y, work.loss)
            return _zeroed(part, lambda: run(work.x, work.y))
        if library != "pipepar.distributed":
            raise ValueError(
                f"library {library!r} is not limit, torch, hand, hand-autograd or "
                "pipepar.distributed"
            )
        import pipepar.distributed as ppd

        bal = pipepar_balance(schedule, len(model), world)
        pipe = ppd.wrap(model, bal, chunks=m, schedule=schedule, checkpoint="never")
        return _zeroed(pipe, lambda: pipe.step(work.x, work.y, work.loss))

    return build


def _zeroed(module: nn.Module, backward: Callable[[], Any]) -> Step:
    """``backward()``, then ``module``'s gradients set to None (no optimizer step)."""

    def step() -> None:
        backward()
        module.zero_grad(set_to_none=True)

    return step


@contextlib.contextmanager
def _switch(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` inside the block, then as before."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
