"""The memory-saving schedules on a model as its authors wrote it: transformers' GPT-2 (its own
``forward``, its own loss under ``labels=``, the head tied to the token embedding), each
schedule's activation peak on every rank beside the planner's prediction, and its training rate
across ranks and in one process, all against 1F1B's in the same run.

Memory: ``pipepar.distributed.wrap`` on K spawned gloo ranks (one stage per rank for 1F1B, two
for the V schedules). After a warm-up step each rank runs one step while a thread samples the C
allocator's bytes in use every 0.2 ms (:class:`benchmarks._procs.MallocPeak`: every thread's
allocations, the forwards of a model cut while it runs are computed on threads of the rank's
own, which ``torch.profiler``'s allocator events do not see); its activation peak is the largest
rise during the step less the rank's parameter gradients (made anew each step). The messages
between ranks are counted in it, as they are in a rank's memory. The prediction beside it is the
planner's (:class:`pipepar.planner.stage_memory.MemoryModel` over a ``meta`` profile of the same
model and batch) for that device, less its parameters and gradients. ``+offload`` rows run the
schedule with ``offload=True``: on the CPU what is away sits in pages of its own, outside
torch's allocator and the C heap, as host memory is outside a GPU's.

Rate: the same pipes, the schedules alternating in blocks of steps (the order rotating each
round), every step started by a barrier, the slowest rank's time; and ``pipepar.wrap`` on K
``"cpu"`` workers in one process. The median samples/s, the p10-p90 spread, and the ratio to
1F1B's median with a bootstrap interval.

Balance: the blocks evened over the stages, the embeddings with the first block and the final
norm and the head with the last (``[4, 1, 1, 1, 1, 1, 1, 3]`` for 8 blocks on 8 stages).

    python benchmarks/bench_real_schedules.py --write      # K = 2 and 4, writes RESULTS.md
    python benchmarks/bench_real_schedules.py --quick      # seconds; CI smoke test
    python benchmarks/bench_real_schedules.py --workers 2 --schedules 1f1b,v-min --rounds 2
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record
from benchmarks.bench_vschedules import against_1f1b
from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.units import format_bytes
from pipepar.planner.stage_memory import MemoryModel

TITLE = "Memory-saving schedules on transformers' GPT-2: activation peak per rank and rate"
SCHEDULES = ("1f1b", "zb-v", "v-half", "v-min", "1f1b+offload")
QUICK = ("1f1b", "v-min", "1f1b+offload")
OFFLOAD = "+offload"


@dataclass(frozen=True)
class Job:
    """The model, one step's token ids (the labels too) and its blocks."""

    model: nn.Module
    ids: Tensor
    blocks: int
    description: str


def job(quick: bool) -> Job:
    """transformers' GPT2LMHeadModel, seeded: 8 blocks x 256 (4 x 32 with ``quick``)."""
    from models import transformers_zoo as zoo

    layers, hidden, heads, vocab, seq, rows = (4, 32, 2, 64, 16, 8) if quick else (
        8, 256, 4, 2048, 64, 32)  # fmt: skip
    torch.manual_seed(0)
    model = zoo.gpt2(layers=layers, hidden=hidden, heads=heads, vocab=vocab, positions=seq)
    ids = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    text = (f"transformers GPT2LMHeadModel {layers} blocks x {hidden}, vocab {vocab}, tied head, "
            f"{rows} x {seq} tokens, labels= (its own loss)")  # fmt: skip
    return Job(model, ids, layers, text)


def schedule_of(contender: str) -> tuple[str, bool]:
    """The schedule's name and whether it offloads: ``"1f1b+offload"`` -> ("1f1b", True)."""
    name = contender.removesuffix(OFFLOAD)
    return name, name != contender


def stages(contender: str, k: int) -> int:
    """2K stages for the V schedules, else K."""
    return 2 * k if schedule_of(contender)[0] in VIRTUAL else k


def balance(blocks: int, n: int) -> list[int]:
    """Units per stage: the blocks evened over ``n`` stages, the three units before the first
    block (token and position embeddings, dropout) with it, the final norm and the head with
    the last (:func:`pipepar.units` lists GPT-2's units in that order)."""
    per, extra = divmod(blocks, n)
    out = [per + (1 if s < extra else 0) for s in range(n)]
    out[0] += 3
    out[-1] += 2
    return out


def predicted(prof: pipepar.Profile, contender: str, k: int, m: int, blocks: int) -> list[int]:
    """Per device, the planner's peak less its parameters and gradients."""
    name, offload = schedule_of(contender)
    n = stages(contender, k)
    order = make(name, n, m, n_workers=k)
    memory = MemoryModel(prof, order, checkpoint="never", foreach=[False] * k, offload=offload,
                         ranks="program")  # fmt: skip
    ranges = common.stage_ranges(balance(blocks, n))
    out = []
    for w in range(k):
        mine = [ranges[s] for s in order.stages_of(w)]
        static = sum(memory.static_bytes(a, b) for a, b in mine)
        out.append(sum(p.peak_bytes for p in memory.device(w, mine)) - static)
    return out


class _Step:
    """One ``pipe.step`` on the job's batch, gradients let go after it; ``static_bytes``: the
    gradients the step makes anew (what the rank's peak is measured beyond)."""

    def __init__(self, pipe: Any, ids: Tensor) -> None:
        self.pipe, self.ids = pipe, ids
        self.static_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters()
                                if p.requires_grad)  # fmt: skip

    def __call__(self) -> None:
        self.pipe.step(input_ids=self.ids, labels=self.ids)
        self.pipe.zero_grad(set_to_none=True)


def rank_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], _Step]:
    """Factory run on every rank: ``build(contender, m) -> step`` of ``pipepar.distributed``."""
    from pipepar.local import cpu_malloc

    cpu_malloc.tune()
    work = job(spec["quick"])

    def build(contender: str, m: int) -> _Step:
        import pipepar.distributed as ppd

        name, offload = schedule_of(contender)
        split = balance(work.blocks, stages(contender, world))
        pipe = ppd.wrap(copy.deepcopy(work.model), split, chunks=m, schedule=name,
                        offload=offload, sample={"input_ids": work.ids})  # fmt: skip
        return _Step(pipe, work.ids)

    return build


def across_ranks(
    work: Job, k: int, m: int, args: argparse.Namespace
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Each contender's measured activation peak per rank, and the samples/s of its steps."""
    block = math.ceil(args.steps / args.rounds)
    spec = {"quick": args.quick}  # a real model's first call on a loaded machine: minutes
    group = ProcessGroup(k, "benchmarks.bench_real_schedules:rank_builder", spec, timeout=1200)
    try:
        peaks = {}
        for name in args.schedules:
            got = group.peaks(name, m)
            if isinstance(got, str):
                raise common.RemoteError(got)
            peaks[name] = got
        timers = {n: common.remote_block(group, n, m, block, 1) for n in args.schedules}
        runs = common.alternate(timers, args.rounds)
    finally:
        group.close()
    rows = work.ids.shape[0]
    return peaks, {n: [rows / t for r in runs[n] for t in r] for n in args.schedules}


def one_process(work: Job, k: int, m: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Samples/s of each contender's steps with ``pipepar.wrap`` on K CPU workers."""
    block = math.ceil(args.steps / args.rounds)
    steps, pipes = {}, []
    for contender in args.schedules:
        name, offload = schedule_of(contender)
        split = balance(work.blocks, stages(contender, k))
        pipe = pipepar.wrap(copy.deepcopy(work.model), split, devices=["cpu"] * k, chunks=m,
                            schedule=name, offload=offload)  # fmt: skip
        step = _Step(pipe, work.ids)
        step()  # warm-up (and worker start)
        steps[contender], pipes = common.local_block(step, block, 1), [*pipes, pipe]
    runs = common.alternate(steps, args.rounds)
    for pipe in pipes:
        pipe.close()
    rows = work.ids.shape[0]
    return {n: [rows / t for r in runs[n] for t in r] for n in args.schedules}


def measure(work: Job, k: int, m: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per contender on K devices."""
    prof = pipepar.profile(work.model, {"input_ids": work.ids, "labels": work.ids},
                           device="meta", optimizer=None)  # fmt: skip
    peaks, rank_rates = across_ranks(work, k, m, args)
    ranks, local = against_1f1b(rank_rates), against_1f1b(one_process(work, k, m, args))
    ref = max(peaks["1f1b"])
    rows = []
    for name in args.schedules:
        top = max(range(k), key=lambda w: peaks[name][w])
        guess = predicted(prof, name, k, m, work.blocks)
        rows.append({
            "schedule": name, "k": k, "m": m, "balance": balance(work.blocks, stages(name, k)),
            "measured": peaks[name], "predicted": guess, "peak": peaks[name][top],
            "peak_predicted": guess[top], "of_1f1b_memory": peaks[name][top] / ref,
            "ranks": ranks[name], "one_process": local[name],
        })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (K, contender)."""
    lines = []
    for r in rows:
        err = r["peak_predicted"] / r["peak"] - 1
        cells = [r["k"], r["m"], r["schedule"], str(r["balance"]),
                 f"{format_bytes(r['peak'])} ({format_bytes(r['peak_predicted'])}, {err:+.1%})",
                 f"{r['of_1f1b_memory']:.2f}x"]  # fmt: skip
        for where in ("ranks", "one_process"):
            s = r[where]
            lo, hi = s["rate_interval"]
            cells += [
                f"{s['median']:.1f} ({s['spread']:.0%})",
                f"{s['of_1f1b_rate']:.2f}x ({lo:.2f}-{hi:.2f})",
            ]
        lines.append(cells)
    headers = ["K", "M", "schedule", "balance (units per stage)",
               "activation peak, fullest rank (predicted, error)", "x 1F1B memory",
               "ranks: samples/s median (spread p10-p90)", "ranks: x 1F1B rate (90% interval)",
               "one process: samples/s median (spread)",
               "one process: x 1F1B rate (90% interval)"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    before = common.load()
    work = job(args.quick)
    rows = [r for k in args.workers for r in measure(work, k, args.chunks, args)]
    text = table(rows)
    note = (
        f"Job: {work.description}, no optimizer, checkpoint='never', M={args.chunks}. "
        "Activation peak: a rank's largest rise in the C allocator's bytes in use (sampled "
        "every 0.2 ms, every thread) over one step after a warm-up step, less its parameter "
        "gradients (messages between ranks included); "
        "predicted: the planner's MemoryModel for that device over a meta profile, less its "
        "parameters and gradients. Rates: pipepar.distributed.wrap on K spawned gloo ranks "
        "(every step after a barrier, the slowest rank's time) and pipepar.wrap on K 'cpu' "
        f"workers in one process; {args.rounds} rounds x {math.ceil(args.steps / args.rounds)} "
        "timed steps per contender after one untimed step per block, order rotating. The "
        f"2-core machine is shared with other jobs: machine load before {before}; after "
        f"{common.load()}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "real_schedules"))
    common.write_json(args.json, rows)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=4)
    common.add_schedule_options(parser)
    parser.add_argument(
        "--schedules", type=lambda t: tuple(t.split(",")), default=None,
        help=f"contenders, 1f1b first (default {','.join(SCHEDULES)}; +offload: offload=True)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.schedules = args.schedules or (QUICK if args.quick else SCHEDULES)
    if args.schedules[0] != "1f1b":
        parser.error("--schedules must start with 1f1b (the reference)")
    if args.quick:
        args.rounds, args.steps, args.workers, args.chunks = 1, 2, [2], 4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
