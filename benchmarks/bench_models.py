"""Real models against the same run's limit: transformers' GPT-2 and Llama through pipepar.

The job, per model: transformers' ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` as the library
builds it (``models/transformers_zoo.py``: 8 blocks x hidden 256, 4 heads, vocabulary 2048;
GPT-2 with its tied head, Llama with 2 key-value heads and an intermediate size of 768, Llama's
own rule of 8/3 x hidden rounded up to a multiple of 256), random weights (seeded), a batch of
16 x 64 seeded random token ids with ``labels`` = the ids (the model's own loss), M = 8
micro-batches, forward + backward, gradients set to None each step (no optimizer), one math
thread per stage or process.

Two references, measured in the same run as everything else:

- **one core**: the same 8 micro-batches one after another in this process, one thread,
  ``(model(input_ids=part, labels=part).loss / 8).backward()`` each (1.0x);
- **limit**: that job in each of two processes at once, a barrier around each step; twice its
  rate is what the two cores do together while they share caches and memory bandwidth.

A third, on by default (``limit-threads``): that job on each of two threads of this process at
once (a copy of the model each, one math thread each), both started together every step. Its
rate over the limit's is what one interpreter lock leaves of the two cores: the ceiling of any
pipe whose stages are threads of one process, as ``pipepar.wrap``'s are.

The contenders differ only in how the model is run (all call ``pipe.step(input_ids=ids,
labels=ids)``, the pipe joining the micro-batches' losses into the whole batch's):

- ``pipepar-1stage``: ``pipepar.wrap(model, [all units], devices=["cpu"], chunks=8,
  threads=1)``: one stage, one worker: what the pipe costs over the plain model;
- ``pipepar:<schedule>``: ``pipepar.wrap(model, split=[middle block], devices=["cpu", "cpu"],
  chunks=8, schedule=..., threads=1)`` in this process for gpipe, 1f1b, zb-h1, and four
  stages (split at blocks 2, 4 and 6, two per worker) for interleaved-1f1b and zb-v;
- ``pipepar.distributed:<schedule>``: ``pipepar.distributed.wrap(model, split=[...], chunks=8,
  schedule=...)`` on two spawned gloo ranks (the model built whole on each), same splits.

- ``hand-threads`` (on by default; GPT-2 only, n/a for Llama): the same GPT-2 cut by hand at
  its middle block and run as a two-stage pipeline on two threads of this process, no pipepar
  (the halves called directly, activations and gradients over queues, plain ``backward()``,
  GPipe order): what the simplest pipeline of the same split reaches in one process.
- ``pipepar-chain:<schedule>`` (asked for by ``--contenders``; GPT-2 only): the same GPT-2
  laid out by hand as an ``nn.Sequential`` of its modules (embeddings, blocks, final norm, an
  untied head) through ``pipepar.wrap(layers, balance, ...)``: the same arithmetic run by the
  chain compute instead of the model's own forward cut while it runs, which tells what the
  cut's machinery costs on this model.

A contender that cannot be built or run is reported ``n/a: <error>`` and the rest go on.

Method (as ``bench_schedules.py``, whose machinery this shares through ``_common``): per model,
contenders alternate in rounds, each running a block of steps after an untimed one, the order
rotating from round to round; multi-process ones stay alive in their process groups
(``_procs.ProcessGroup``). Every step is timed on its own (on two ranks: all start it after a
barrier and its time is the slower rank's) and turned into samples/s. The table gives the
median and 90th-percentile rate, the p10-p90 spread, x one core and the fraction of the limit
(p90 against p90, medians in brackets) with a bootstrap 90% interval (2000 redraws of both
contenders' steps). Under each table: the one-stage overhead (the median step of the one-stage
pipe over the one-core run's, with a bootstrap interval), and the team's targets (a real
model in one process >= 0.90 of the limit, across ranks >= 0.85, one stage <= +5%), each
met, missed, or within the uncertainty of the interval.

Default: 3 rounds x 8 timed steps per contender (24 steps, each block after one untimed step),
both models, 15 contenders each: about 10 minutes on a quiet 2-core CPU, about 18 under a load
average of 5 (a round of every contender's step takes ~8 s quiet, ~17 s loaded, plus ~30-45 s
per model to spawn the ranks and build).

    python benchmarks/bench_models.py --write          # both models, every contender
    python benchmarks/bench_models.py --models gpt2 --rounds 2 --steps 6 \\
        --contenders pipepar-1stage:gpipe,pipepar:zb-v,pipepar.distributed:zb-h1
    python benchmarks/bench_models.py --quick          # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core per thread, in every process
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import copy
import math
import queue
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks._contenders import SETTLE
from benchmarks._procs import ProcessGroup, close_groups, library_groups
from benchmarks._results import record
from pipepar.local import cpu_malloc

TITLE = "Real models as they are: what the cut costs"  # the section --write replaces
MODELS = {"gpt2": "GPT-2", "llama": "Llama"}
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}  # module path of the block list
UNIT, LIMIT, ONE_STAGE = "one core:", "limit:", "pipepar-1stage:gpipe"
THREADS = "limit-threads:"  # the one-core job on two threads of one process
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
LIBRARIES = {  # library: (label, processes, notes)
    "one core": ("one core (reference)", 1, "the micro-batches one after another"),
    "limit": ("limit: one-core job x 2 processes", 2, "physical limit of the 2 cores"),
    "limit-threads": (
        "one-core job x 2 threads of one process",
        1,
        "what one interpreter lock leaves of the 2 cores: a ceiling of pipepar.wrap",
    ),
    "hand-threads": (
        "hand-written pipeline, 2 threads of one process",
        1,
        "GPT-2 only: the halves called directly, queues, plain backward; GPipe order",
    ),
    "pipepar-1stage": ("pipepar.wrap, 1 stage", 1, "balance=[all units], one worker"),
    "pipepar": ("pipepar.wrap, pipe.step", 1, "one thread per core"),
    "pipepar-chain": (
        "pipepar.wrap, the blocks as an nn.Sequential",
        1,
        "GPT-2 only: embeddings, blocks, ln_f, an untied head as layers (the chain compute)",
    ),
    "pipepar.distributed": (
        "pipepar.distributed",
        2,
        "gloo, stage messages through shared memory, model built whole on each rank",
    ),
    "pipepar.distributed-chain": (
        "pipepar.distributed, the blocks as an nn.Sequential",
        2,
        "GPT-2 only: as pipepar-chain, on two gloo ranks",
    ),
}
REMOTE = ("limit", "pipepar.distributed", "pipepar.distributed-chain")
BOUND = (
    "Every two-process contender, the limit included, binds each rank to a core of its own "
    "(pipepar.distributed.bind_cores: rank r on core r)."
)
UNBOUND = "The two-process contenders' threads may run on either core (--no-bind-cores)."
CHOSEN_BY_USER = (
    "limit-threads", "hand-threads", "pipepar-1stage", "pipepar", "pipepar-chain",
    "pipepar.distributed", "pipepar.distributed-chain",
)  # fmt: skip
CONTENDERS = (
    THREADS,
    "hand-threads:gpipe",
    ONE_STAGE,
    *(f"pipepar:{s}" for s in SCHEDULES),
    *(f"pipepar.distributed:{s}" for s in SCHEDULES),
)
QUICK = (ONE_STAGE, "pipepar:1f1b", "pipepar:zb-v", "pipepar.distributed:1f1b")
TARGETS = {"pipepar": 0.90, "pipepar.distributed": 0.85}  # of the limit, p90; one stage: +5%
OVERHEAD_TARGET = 0.05


# -- the job -----------------------------------------------------------------------------------
@dataclass
class Job:
    """A model as transformers builds it, its token ids (also its labels) and its sizes."""

    name: str
    model: nn.Module
    ids: Tensor
    layers: int
    description: str

    @property
    def batch(self) -> int:
        """Rows (sequences) in the mini-batch."""
        return int(self.ids.shape[0])


def sizes(quick: bool) -> dict[str, int]:
    """The models' sizes and the batch: the benchmark's, or tiny ones for CI."""
    if quick:
        return dict(layers=2, hidden=32, heads=2, vocab=64, seq=16, batch=8)
    return dict(layers=8, hidden=256, heads=4, vocab=2048, seq=64, batch=16)


def intermediate(hidden: int) -> int:
    """Llama's MLP width: 8/3 x hidden rounded up to a multiple of 256 (of hidden if less)."""
    step = min(256, hidden)
    return step * math.ceil(8 * hidden / 3 / step)


def job(name: str, *, quick: bool = False) -> Job:
    """Model ``name`` (``"gpt2"`` or ``"llama"``), seeded, with seeded random token ids."""
    from models import transformers_zoo as zoo

    size = sizes(quick)
    common_sizes: dict[str, Any] = {k: size[k] for k in ("layers", "hidden", "heads")}
    torch.manual_seed(0)
    if name == "gpt2":
        model = zoo.gpt2(**common_sizes, vocab=size["vocab"], positions=size["seq"])
        extra = "tied head"
    elif name == "llama":
        width = intermediate(size["hidden"])
        model = zoo.llama(**common_sizes, vocab=size["vocab"], intermediate=width)
        extra = f"2 key-value heads, intermediate {width}"
    else:
        raise ValueError(f"model {name!r} is not one of {list(MODELS)}")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(size["vocab"], (size["batch"], size["seq"]), generator=gen)
    text = (
        f"{MODELS[name]} {size['layers']} blocks x hidden {size['hidden']}, {size['heads']} "
        f"heads ({extra}), vocab {size['vocab']}, {size['batch']} x {size['seq']} tokens"
    )
    return Job(name, model, ids, size["layers"], text)


def stages(schedule: str) -> int:
    """Stages of a two-worker pipe: two, or four for the virtual-stage schedules."""
    from pipepar.core.named_schedules import VIRTUAL

    return 4 if schedule in VIRTUAL else 2


def split(work: Job, n_stages: int) -> list[str]:
    """Module paths where stages 2..n begin: equal runs of blocks (8 blocks, 2 stages: block 4)."""
    if work.layers % n_stages:
        raise ValueError(
            f"{work.layers} blocks do not split into {n_stages} equal stages (a virtual-stage "
            "schedule needs 4 stages; run without --quick)"
        )
    paths = [f"{BLOCKS[work.name]}.{work.layers * i // n_stages}" for i in range(1, n_stages)]
    units = {unit.path for unit in pipepar.units(work.model)}
    missing = [p for p in paths if p not in units]
    if missing:
        raise ValueError(f"{missing} are not units of {work.name}: {sorted(units)}")
    return paths


def one_core(work: Job, m: int) -> common.Step:
    """The reference: the m micro-batches one after another on a copy of the model."""
    model = copy.deepcopy(work.model)
    parts = work.ids.tensor_split(m)

    def step() -> None:
        for part in parts:
            (model(input_ids=part, labels=part).loss / m).backward()
        model.zero_grad(set_to_none=True)

    return step


class TwoThreads:
    """Two jobs on two threads of this process at once (one math thread each): :meth:`step`
    starts both and returns when both are done (a failure on either is raised there)."""

    def __init__(self, jobs: tuple[common.Step, common.Step]) -> None:
        self._start, self._end = threading.Barrier(3), threading.Barrier(3)
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._serve, args=(job,), daemon=True) for job in jobs
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self, job: common.Step) -> None:
        torch.set_num_threads(1)
        while True:
            try:
                self._start.wait()
            except threading.BrokenBarrierError:
                return  # closed
            try:
                job()
            except BaseException as error:
                self._errors.append(error)
            self._end.wait()

    def step(self) -> None:
        self._start.wait()
        self._end.wait()
        if self._errors:
            error, self._errors[:] = self._errors[0], []
            raise error

    def close(self) -> None:
        self._start.abort()
        for thread in self._threads:
            thread.join()


@dataclass
class Halves:
    """GPT-2 of a job cut by hand at its middle block (a copy of the model): ``front(ids)``
    runs the embeddings and the first half of the blocks; ``back(h, ids)`` the other half, the
    final norm, the tied head and the model's causal loss."""

    model: nn.Module
    front: Callable[[Tensor], Tensor]
    back: Callable[[Tensor, Tensor], Tensor]


def gpt2_halves(work: Job) -> Halves:
    """:class:`Halves` of the job's GPT-2, checked to compute the model's own loss."""
    if work.name != "gpt2":
        raise ValueError(f"the hand-written halves are GPT-2's only, not {work.name!r}")
    model = copy.deepcopy(work.model)
    body, half = model.transformer, work.layers // 2
    first = nn.Sequential(_Embed(body.wte, body.wpe), body.drop, *map(_Block, body.h[:half]))
    last = nn.Sequential(*map(_Block, body.h[half:]), body.ln_f, model.lm_head)

    def back(h: Tensor, ids: Tensor) -> Tensor:
        return causal_loss(last(h), ids)

    sample = work.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(
            back(first(sample), sample), model(input_ids=sample, labels=sample).loss
        )
    return Halves(model, first, back)


class HandThreads:
    """The job's GPT-2 as a hand-written two-stage pipeline on two threads of this process (no
    pipepar): the first thread runs every micro-batch's front half, handing each activation
    over a queue, then their backwards as the gradients come back; the second runs each
    micro-batch's back half, loss and backward as it arrives. GPipe's bubble on two stages
    (M / (M + 1) of the ideal at best), no checks, no hooks. :meth:`run` leaves the gradients
    in :attr:`model`; :meth:`step` sets them to None after."""

    WAIT = 120.0  # seconds: a failing half ends the other's wait instead of hanging it

    def __init__(self, work: Job, m: int) -> None:
        halves = gpt2_halves(work)
        self.model = halves.model
        self._halves, self._parts = halves, work.ids.tensor_split(m)
        self._acts: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        self._grads: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        self._threads = TwoThreads((self._first, self._last))

    def _first(self) -> None:
        kept = []
        for ids in self._parts:
            h = self._halves.front(ids)
            self._acts.put(h.detach())
            kept.append(h)
        for h in kept:
            h.backward(self._grads.get(timeout=self.WAIT))

    def _last(self) -> None:
        for ids in self._parts:
            x = self._acts.get(timeout=self.WAIT).requires_grad_(True)
            (self._halves.back(x, ids) / len(self._parts)).backward()
            assert x.grad is not None
            self._grads.put(x.grad)

    def run(self) -> None:
        self._threads.step()

    def step(self) -> None:
        self.run()
        self.model.zero_grad(set_to_none=True)

    def close(self) -> None:
        self._threads.close()


def _stepped(pipe: Any, ids: Tensor) -> common.Step:
    def step() -> None:
        pipe.step(input_ids=ids, labels=ids)
        pipe.zero_grad(set_to_none=True)

    return step


def one_process(library: str, schedule: str, work: Job, m: int) -> tuple[common.Step, Any]:
    """``(step, pipe)`` of ``"pipepar-1stage"``, ``"pipepar"`` (two CPU workers),
    ``"pipepar-chain"``, or of ``"limit-threads"`` (:class:`TwoThreads`) and ``"hand-threads"``
    (:class:`HandThreads`) in place of a pipe."""
    if library == "limit-threads":
        threads = TwoThreads((one_core(work, m), one_core(work, m)))
        return threads.step, threads
    if library == "hand-threads":
        hand = HandThreads(work, m)
        return hand.step, hand
    model = copy.deepcopy(work.model)
    if library == "pipepar-1stage":
        balance = [len(pipepar.units(model))]
        pipe = pipepar.wrap(
            model, balance, devices=["cpu"], chunks=m, schedule=schedule, threads=1,
            checkpoint="never",
        )  # fmt: skip
    elif library == "pipepar":
        pipe = pipepar.wrap(
            model, split=split(work, stages(schedule)), devices=["cpu", "cpu"], chunks=m,
            schedule=schedule, threads=1, checkpoint="never",
        )  # fmt: skip
    elif library == "pipepar-chain":
        layers, loss_fn = gpt2_chain(work)
        pipe = pipepar.wrap(
            layers, chain_balance(len(layers), stages(schedule)), devices=["cpu", "cpu"],
            chunks=m, schedule=schedule, threads=1, checkpoint="never",
        )  # fmt: skip

        def step() -> None:
            pipe.step(work.ids, work.ids, loss_fn)
            pipe.zero_grad(set_to_none=True)

        return step, pipe
    else:
        raise ValueError(
            f"library {library!r} is not limit-threads, hand-threads, pipepar-1stage, pipepar "
            "or pipepar-chain"
        )
    return _stepped(pipe, work.ids), pipe


class _Embed(nn.Module):
    """GPT-2's token and position embeddings as one layer."""

    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids: Tensor) -> Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class _Block(nn.Module):
    """A GPT-2 block taking and returning the hidden states alone."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: Tensor) -> Tensor:
        out = self.block(h)
        return out[0] if isinstance(out, tuple) else out


def causal_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """GPT-2's own loss: each position's logits against the next token."""
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(shifted, ids[:, 1:].reshape(-1))


def chain_balance(layers: int, n_stages: int) -> list[int]:
    """Layers per stage of the hand-made chain, cut where ``split`` cuts the model: equal runs
    of blocks, the embeddings with the first, the final norm and head with the last."""
    blocks = layers - 3
    per = [blocks // n_stages] * n_stages
    per[0] += 1
    per[-1] += 2
    return per


def gpt2_chain(work: Job) -> tuple[nn.Sequential, Callable[[Tensor, Tensor], Tensor]]:
    """The job's GPT-2 laid out by hand as an ``nn.Sequential`` of the same modules (a copy):
    embeddings, each block, the final norm, and the head as a layer of its own (untied: a
    weight shared by the first and last layer would span stages), with the model's causal
    loss. The same arithmetic as the model's forward, run by the chain compute."""
    if work.name != "gpt2":
        raise ValueError(f"pipepar-chain lays out GPT-2 only, not {work.name!r}")
    transformer = copy.deepcopy(work.model).transformer
    embed = transformer.wte.weight
    head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
    head.weight = nn.Parameter(embed.detach().clone())
    blocks = [_Block(b) for b in transformer.h]
    embeddings = _Embed(transformer.wte, transformer.wpe)
    layers = nn.Sequential(embeddings, *blocks, transformer.ln_f, head)

    return layers, causal_loss


def rank_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], common.Step]:
    """Factory run on every rank of a ProcessGroup: ``build("library:schedule", m) -> step``
    for ``"limit:"`` (this rank alone runs the one-core job) and
    ``"pipepar.distributed:<schedule>"``. Every rank gets pipepar's malloc thresholds, as the
    benchmark's own process does."""
    cpu_malloc.tune()
    work = job(spec["model"], quick=spec["quick"])

    def build(contender: str, m: int) -> common.Step:
        library, _, schedule = contender.partition(":")
        if library == "limit":
            return one_core(work, m)
        import pipepar.distributed as ppd

        if library == "pipepar.distributed-chain":
            layers, loss_fn = gpt2_chain(work)
            pipe = ppd.wrap(
                layers, chain_balance(len(layers), stages(schedule)), chunks=m,
                schedule=schedule, checkpoint="never",
            )  # fmt: skip

            def chain_step() -> None:
                pipe.step(work.ids, work.ids, loss_fn)
                pipe.zero_grad(set_to_none=True)

            return chain_step
        if library != "pipepar.distributed":
            raise ValueError(f"library {library!r} is not limit or pipepar.distributed(-chain)")
        paths = split(work, stages(schedule))
        model = copy.deepcopy(work.model)
        pipe = ppd.wrap(model, split=paths, chunks=m, schedule=schedule, checkpoint="never")
        return _stepped(pipe, work.ids)

    return build


# -- measuring ---------------------------------------------------------------------------------
def _blocks(
    work: Job, groups: dict[str, ProcessGroup], args: argparse.Namespace
) -> tuple[dict[str, common.Block], dict[str, str], list[Any]]:
    """A block timer per contender (the references first), the contenders that could not be
    built (with why), and the in-process pipes (to close)."""
    block, m = math.ceil(args.steps / args.rounds), args.chunks
    unit = one_core(work, m)
    unit()  # warm-up
    timers = {UNIT: common.local_block(unit, block, args.warmup)}
    skipped: dict[str, str] = {}
    pipes = []
    for key in (LIMIT, *args.contenders):
        library, _, schedule = key.partition(":")
        if library in REMOTE:
            timers[key] = common.remote_block(groups[library], key, m, block, args.warmup)
            continue
        try:
            step, pipe = one_process(library, schedule, work, m)
            pipes.append(pipe)
            # Warm-up (and worker start); a pipe times its workers against this thread first.
            for _ in range(SETTLE if library.startswith("pipepar") else 1):
                step()
        except Exception as error:
            skipped[key] = common.why(error)
            continue
        timers[key] = common.local_block(step, block, args.warmup)
    return timers, skipped, pipes


def measure(work: Job, args: argparse.Namespace) -> dict[str, list[float] | str]:
    """Per contender of one model: the seconds of every timed step, or why it has none."""
    spec = {"model": work.name, "quick": args.quick}
    wanted = {"limit"} | {k.partition(":")[0] for k in args.contenders}
    groups = library_groups(
        (lib for lib in REMOTE if lib in wanted),
        partial(
            ProcessGroup,
            2,
            "benchmarks.bench_models:rank_builder",
            spec,
            bind_cores=args.bind_cores,
        ),
        shared=args.quick,
    )
    pipes: list[Any] = []
    try:
        timers, skipped, pipes = _blocks(work, groups, args)
        return common.run_blocks(timers, skipped, args.rounds, (UNIT, LIMIT, *args.contenders))
    finally:
        close_groups(groups)
        for pipe in pipes:
            getattr(pipe, "close", lambda: None)()


# -- report ------------------------------------------------------------------------------------
def rows(name: str, times: dict[str, list[float] | str], batch: int) -> list[dict[str, Any]]:
    """One row per contender of model ``name``: rate quantiles, x one core, fraction of the
    limit; the one-stage row also has the overhead (median step time over one core's)."""
    samples = {k: batch * (2 if k in (LIMIT, THREADS) else 1) for k in times}
    stats = common.against_limit(times, samples, UNIT, LIMIT)
    out = []
    for key in times:
        library, _, schedule = key.partition(":")
        label, processes, _ = LIBRARIES[library]
        row: dict[str, Any] = {"model": name, "key": key, "contender": label}
        row |= {"schedule": schedule or "-", "processes": processes} | stats[key]
        mine, unit = times[key], times[UNIT]
        if library == "pipepar-1stage" and isinstance(mine, list) and isinstance(unit, list):
            ratio = statistics.median(mine) / statistics.median(unit)
            lo, hi = common.ratio_interval(mine, unit, statistics.median)
            row |= {"overhead": ratio - 1, "overhead_interval": (lo - 1, hi - 1)}
        out.append(row)
    return out


def _verdict(low: float, high: float, target: float, *, at_most: bool = False) -> str:
    if at_most:
        low, high, target = -high, -low, -target
    if low >= target:
        return "met"
    return "missed" if high < target else "within the uncertainty"


def summary(result: list[dict[str, Any]]) -> str:
    """The targets, one line each: best schedule in one process and across ranks (p90 of the
    limit) and the one-stage overhead, each with its interval and verdict."""
    lines = []
    for library, target in TARGETS.items():
        mine = [r for r in result if r["key"].startswith(library + ":") and not r["error"]]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["of_limit"] or 0.0)
        if best["of_limit"] is None:
            continue
        lo, hi = best["of_limit_interval"]
        lines.append(
            f"- {LIBRARIES[library][0]}, best schedule {best['schedule']}: "
            f"{best['of_limit']:.2f} of the limit (90% interval {lo:.2f}-{hi:.2f}; median "
            f"{best['of_limit_median']:.2f}); target >= {target:.2f}: "
            f"{_verdict(lo, hi, target)}."
        )
    threads = next((r for r in result if r["key"] == THREADS and not r["error"]), None)
    if threads is not None and threads["of_limit"] is not None:
        lo, hi = threads["of_limit_interval"]
        lines.append(
            f"- {LIBRARIES['limit-threads'][0]}: {threads['of_limit']:.2f} of the limit (90% "
            f"interval {lo:.2f}-{hi:.2f}; median {threads['of_limit_median']:.2f}): the "
            "ceiling of a pipe whose stages are threads of one process."
        )
    one = next((r for r in result if "overhead" in r), None)
    if one is not None:
        lo, hi = one["overhead_interval"]
        verdict = _verdict(lo, hi, OVERHEAD_TARGET, at_most=True)
        lines.append(
            f"- one-stage pipe over the one-core run (median step times): "
            f"{one['overhead']:+.1%} (90% interval {lo:+.1%} to {hi:+.1%}); target <= "
            f"+{OVERHEAD_TARGET:.0%}: {verdict}."
        )
    return "\n".join(lines)


def report(name: str, result: list[dict[str, Any]], description: str) -> str:
    """The model's heading, table and summary."""
    table = common.limit_table(result, lambda r: LIBRARIES[r["key"].partition(":")[0]][2])
    return f"### {MODELS[name]}: {description}\n\n{table}\n\n{summary(result)}".rstrip()


def notes(args: argparse.Namespace, before: str) -> str:
    block = math.ceil(args.steps / args.rounds)
    return (
        f"M={args.chunks}, the model's own loss (labels = input ids), forward + backward, "
        "gradients set to None each step, no optimizer, one math thread per stage or process "
        "(threads=1; torch.set_num_threads(1) in each rank). "
        f"{BOUND if args.bind_cores else UNBOUND} Two stages split at the middle "
        "block; interleaved-1f1b and zb-v four equal stages (8 blocks: split at blocks 2, 4 "
        f"and 6), two per worker. Per model: {args.rounds} round(s) x {block} timed steps per "
        f"contender after {args.warmup} untimed step(s) per block, order rotating; a step's "
        "time on two processes is the slower rank's, every step started after a barrier. "
        "Rate = samples "
        "per step / step time (limit: 2 x batch). x one core and of limit compare p90 rates "
        "(medians in brackets) with the same run's one core and limit; intervals are "
        "bootstraps (2000 redraws of both contenders' steps). Every process runs with "
        "pipepar's malloc thresholds (pipepar.local.cpu_malloc). Machine load before: "
        f"{before}; after: {common.load()}."
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables; write them to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    cpu_malloc.tune()  # the same allocator settings in every process (the ranks do the same)
    torch.set_num_threads(1)
    before = common.load()
    sections, result = [], []
    for name in args.models:
        work = job(name, quick=args.quick)
        mine = rows(name, measure(work, args), work.batch)
        sections.append(report(name, mine, work.description))
        print(sections[-1], end="\n\n", flush=True)
        result += mine
    note = notes(args, before)
    print(note)
    if args.write:
        text = "\n\n".join(sections)
        record(TITLE, text, notes=note, path=common.results_path(args, "models"))
    common.write_json(args.json, [{k: v for k, v in r.items() if k != "rates"} for r in result])
    return 0


def _keyed(contender: str) -> str:
    """``library:schedule`` (gpipe where no schedule is named; none for the threads' limit)."""
    if contender.partition(":")[0] == THREADS[:-1]:
        return THREADS
    return contender if ":" in contender else f"{contender}:gpipe"


def _listed(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=3)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per block")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    parser.add_argument(
        "--no-bind-cores",
        dest="bind_cores",
        action="store_false",
        help="leave the two-process contenders' threads on every core (default: each rank "
        "bound to a core of its own, pipepar.distributed.bind_cores)",
    )
    parser.add_argument(
        "--models", type=_listed, default=list(MODELS), help="comma list of: gpt2, llama"
    )
    parser.add_argument(
        "--contenders",
        type=_listed,
        default=None,
        help=f"library:schedule list (libraries: {', '.join(CHOSEN_BY_USER)}; no schedule: "
        "gpipe); the references (one core, limit) always run; unknown schedules are reported "
        "n/a. Default: " + ",".join(CONTENDERS),
    )
    args = parser.parse_args(argv)
    args.contenders = args.contenders or list(QUICK if args.quick else CONTENDERS)
    args.contenders = [_keyed(c) for c in args.contenders]
    bad = [c for c in args.contenders if c.partition(":")[0] not in CHOSEN_BY_USER]
    if bad:
        parser.error(f"unknown library in {bad}; use e.g. pipepar:1f1b or pipepar-1stage:gpipe")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if args.quick:
        args.rounds, args.steps = 1, min(args.steps, 2)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
