"""V-Half and V-Min against 1F1B (and ZB-V) on the GPT of models/: each schedule's activation
peak per device, measured beside the planner's prediction, and its training rate in one process,
all in the same run.

Memory: every device's peak over one training step (after a warm-up step) by
:func:`pipepar.planner.measure.measure_device`: the device's stages run their actions in the
device's own order of the schedule (two stages per device for the V schedules), the peak read
from the CPU allocator's events that ``torch.profiler`` records, plus resident parameters and
Adam state. The activation peak is that peak less the device's parameters, gradients and Adam
state (what the schedule cannot change); the table gives the largest over the devices, and the
planner's prediction for the same device (:class:`pipepar.planner.stage_memory.MemoryModel`
walking its action list, over a meta profile) beside it.

Rate: ``pipepar.wrap(model, balance, devices=["cpu"] * K, chunks=M, schedule=...)`` and
``pipe.step``, the schedules alternating in blocks of steps (the order rotating each round) so
that the load of the shared machine hits all alike; each step's samples/s, the median and the
p10-p90 spread, and the ratio to 1F1B's median with a bootstrap interval of that ratio (2000
redraws of both schedules' steps).

Balance: forward FLOPs evened over K stages (1F1B) or 2K (the V schedules: worker ``w`` holds
stages ``w`` and ``2K-1-w``).

``auto@50%``: ``pipepar.wrap(..., schedule="auto", memory_budget="50%")`` over 2K stages (V
or looped placement allowed), the fastest order found holding at most half of 1F1B's
micro-batches per device (:mod:`pipepar.core.schedule_budget`); its row gives the budget as
that share of 1F1B's measured activation peak and the measured peak against it. A share below
one micro-batch on a device's stages (0.33 on 2 devices) has no row. ``bytes@50%``: the same
with ``memory_budget`` half of 1F1B's predicted activation peak in bytes (the planner's
:class:`~pipepar.planner.stage_memory.MemoryModel`), the bound the issue's +5% target is about.

    python benchmarks/bench_vschedules.py --write         # K = 2 and 4, writes RESULTS.md
    python benchmarks/bench_vschedules.py --workers 2 --rounds 4 --steps 8
    python benchmarks/bench_vschedules.py --ranks --workers 2 --write   # across 2 ranks
    python benchmarks/bench_vschedules.py --quick         # seconds; CI smoke test
    python benchmarks/bench_vschedules.py --workers 4 --budgets 0.33,0.5,0.75,1 --write
    python benchmarks/bench_vschedules.py --schedules 1f1b,zb-v --budgets 0.5,1   # a subset
    python benchmarks/bench_vschedules.py --schedules 1f1b --byte-budgets 0.5,1   # in bytes
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record
from pipepar.core.memory_budget import for_budget
from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.schedule import Schedule
from pipepar.core.schedule_budget import least_budget, one_f_one_b_held
from pipepar.core.units import format_bytes
from pipepar.planner.measure import measure_device
from pipepar.planner.stage_activations import bytes_schedule, predicted_activations
from pipepar.planner.stage_memory import MemoryModel

TITLE = "V-Half and V-Min vs 1F1B: activation peak and rate (GPT, one process)"
TITLE_AUTO = "schedule='auto' within a memory budget: activation peak and rate (GPT, one process)"
TITLE_RANKS = "V-Half and V-Min vs 1F1B: rate across ranks (GPT, pipepar.distributed)"
SCHEDULES = ("1f1b", "zb-v", "v-half", "v-min")
QUICK = ("1f1b", "v-min", "auto@50%")
OPTIMIZER = "adam"


AUTO = "auto@"
"""Prefix of the auto schedule's contenders: ``auto@50%``, within half of 1F1B's."""


BYTES = "bytes@"
"""Prefix of the auto schedule within a size: ``bytes@50%``, half of 1F1B's predicted
activation peak in bytes (``memory_budget="<bytes>"``)."""


def stages(name: str, k: int) -> int:
    """Stages of a contender on ``k`` devices: 2K for the V schedules and auto, else K."""
    return 2 * k if name in VIRTUAL or name.startswith((AUTO, BYTES)) else k


def share_of(name: str) -> float | None:
    """The share of 1F1B's of an auto contender (0.5 for ``auto@50%``), else None."""
    for prefix in (AUTO, BYTES):
        if name.startswith(prefix):
            return float(name[len(prefix) :].rstrip("%")) / 100
    return None


def budget_of(name: str, work: common.Workload, k: int, m: int) -> str | None:
    """The ``memory_budget`` of an auto contender: ``"50%"``, or a size in bytes."""
    share = share_of(name)
    if share is None:
        return None
    if name.startswith(AUTO):
        return name[len(AUTO) :]
    return str(int(share * _one_f_one_b_bytes(work, k, m)))


_REF: dict[tuple[str, int, int], int] = {}


def _one_f_one_b_bytes(work: common.Workload, k: int, m: int) -> int:
    """1F1B's predicted activation peak (the planner's, its largest device)."""
    key = (work.description, k, m)
    if key not in _REF:
        prof = pipepar.profile(work.model, work.x, device="meta", optimizer=None)
        got = predicted_activations(prof, make("1f1b", k, m, n_workers=k),
                                    common.balance(work, k), "never")  # fmt: skip
        _REF[key] = max(got)
    return _REF[key]


def build(work: common.Workload, name: str, k: int, m: int) -> Schedule:
    """The contender's schedule, as wrap builds it."""
    n, budget = stages(name, k), budget_of(name, work, k, m)
    if budget is None:
        return make(name, n, m, n_workers=k)
    if name.startswith(BYTES):
        return bytes_schedule(work.model, work.x, common.balance(work, n), m, "never",
                              budget=int(budget), n_workers=k)  # fmt: skip
    return for_budget(budget, n, m, n_workers=k)


def feasible(work: common.Workload, name: str, k: int, m: int) -> bool:
    """False for a budget below one micro-batch on all of a device's stages."""
    share = share_of(name)
    if share is None:
        return True
    if name.startswith(BYTES):
        try:
            build(work, name, k, m)
        except ValueError:
            return False
        return True
    return share * one_f_one_b_held(k, m) >= least_budget(stages(name, k), k)


def memory_row(
    work: common.Workload, prof: pipepar.Profile, k: int, m: int, name: str
) -> dict[str, Any]:
    """Per device: measured and predicted activation peak (peak less static bytes)."""
    bal = common.balance(work, stages(name, k))
    order = build(work, name, k, m)
    model = MemoryModel(prof, order, checkpoint="never", foreach=[False] * k)
    ranges = common.stage_ranges(bal)
    measured, predicted = [], []
    for w in range(k):
        mine = [ranges[s] for s in order.stages_of(w)]
        static = sum(model.static_bytes(a, b) for a, b in mine)
        predicted.append(sum(p.peak_bytes for p in model.device(w, mine)) - static)
        got = measure_device(
            work.model, work.x, bal, device=w, chunks=m, optimizer=OPTIMIZER, schedule=order
        )
        measured.append(got - static)
    held = max(order.worker_in_flight(w) for w in range(k))
    return {"schedule": name, "k": k, "m": m, "balance": bal, "held": held,
            "measured": measured, "predicted": predicted}  # fmt: skip


def _step(work: common.Workload, k: int, m: int, name: str) -> tuple[common.Step, Any]:
    model = copy.deepcopy(work.model)
    budget = budget_of(name, work, k, m)
    pipe = pipepar.wrap(model, common.balance(work, stages(name, k)), devices=["cpu"] * k,
                        chunks=m, schedule="auto" if budget else name, memory_budget=budget,
                        sample=work.x, checkpoint="never")  # fmt: skip
    return common.training_step(pipe, work), pipe


def rates(
    work: common.Workload, k: int, m: int, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Samples/s of every timed step of each schedule, blocks alternating over rounds."""
    block = math.ceil(args.steps / args.rounds)
    steps, pipes = {}, []
    names = [name for name in args.schedules if feasible(work, name, k, m)]
    for name in names:
        step, pipe = _step(work, k, m, name)
        step()  # warm-up (and worker start)
        steps[name], pipes = common.local_block(step, block, 1), [*pipes, pipe]
    runs = common.alternate(steps, args.rounds)
    for pipe in pipes:
        pipe.close()
    return {name: [work.batch / t for r in runs[name] for t in r] for name in names}


def rank_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], Any]:
    """Factory run on every rank: ``build("pipepar.distributed:<name>", m) -> step``, the GPT
    balanced by forward FLOPs as in one process."""
    from pipepar.local import cpu_malloc

    cpu_malloc.tune()
    work = common.workload("gpt", quick=spec["quick"])

    def build(contender: str, m: int) -> Callable[[], None]:
        import pipepar.distributed as ppd

        name = contender.partition(":")[2]
        model = copy.deepcopy(work.model)
        budget = budget_of(name, work, world, m)
        pipe = ppd.wrap(model, common.balance(work, stages(name, world)), chunks=m,
                        schedule="auto" if budget else name, memory_budget=budget,
                        sample=work.x, checkpoint="never")  # fmt: skip
        return common.training_step(pipe, work)

    return build


def rank_rates(k: int, m: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Samples/s of every timed step of each schedule on ``k`` spawned gloo ranks (a step's
    time is the slowest rank's, every step started after a barrier), blocks alternating."""
    block = math.ceil(args.steps / args.rounds)
    spec = {"workload": "gpt", "quick": args.quick}
    group = ProcessGroup(k, "benchmarks.bench_vschedules:rank_builder", spec)
    try:
        timers = {n: common.remote_block(group, f"pipepar.distributed:{n}", m, block, 1)
                  for n in args.schedules}  # fmt: skip
        runs = common.alternate(timers, args.rounds)
    finally:
        group.close()
    batch = common.workload("gpt", quick=args.quick).batch
    return {name: [batch / t for r in runs[name] for t in r] for name in args.schedules}


def against_1f1b(per_step: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Each schedule's median rate, spread and ratio to 1F1B's median (bootstrap interval)."""
    ref = per_step["1f1b"]
    out = {}
    for name, got in per_step.items():
        q = common.Quantiles.of(got)
        out[name] = {
            "median": q.median,
            "spread": q.spread(),
            "of_1f1b_rate": q.median / statistics.median(ref),
            "rate_interval": common.ratio_interval(got, ref, stat=statistics.median),
        }
    return out


def measure(work: common.Workload, k: int, m: int, args: argparse.Namespace) -> list[dict]:
    """One row per schedule: memory and rate, and both against 1F1B's."""
    prof = pipepar.profile(work.model, work.x, device="meta", optimizer=OPTIMIZER)
    names = [name for name in args.schedules if feasible(work, name, k, m)]
    rows = [memory_row(work, prof, k, m, name) for name in names]
    speed = against_1f1b(rates(work, k, m, args))
    ref_mem = max(rows[0]["measured"])
    zb_v_rate = speed["zb-v"]["median"] if "zb-v" in speed else None
    for row in rows:
        top = max(range(k), key=lambda w: row["measured"][w])
        share = share_of(row["schedule"])
        row |= {
            "peak": row["measured"][top],
            "peak_predicted": row["predicted"][top],
            "of_1f1b_memory": row["measured"][top] / ref_mem,
            "budget": None if share is None else share * ref_mem,
            "of_budget": None if share is None else row["measured"][top] / (share * ref_mem),
            **speed[row["schedule"]],
        }
        if zb_v_rate:
            row["of_zb_v_rate"] = row["median"] / zb_v_rate
    return rows


def rank_table(k: int, m: int, speed: dict[str, dict[str, Any]]) -> str:
    """One line per schedule: the rate across ranks against 1F1B's."""
    lines = [
        [k, m, name, f"{r['median']:.1f}", f"{r['spread']:.0%}",
         f"{r['of_1f1b_rate']:.2f}x ({r['rate_interval'][0]:.2f}-{r['rate_interval'][1]:.2f})"]
        for name, r in speed.items()
    ]  # fmt: skip
    headers = ["ranks K", "M", "schedule", "samples/s median", "spread p10-p90",
               "x 1F1B rate (90% interval)"]  # fmt: skip
    return markdown_table(headers, lines)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (K, schedule)."""
    lines = []
    for r in rows:
        err = r["peak_predicted"] / r["peak"] - 1
        lo, hi = r["rate_interval"]
        budget = "-" if r.get("budget") is None else (
            f"{format_bytes(r['budget'])} ({r['of_budget']:.2f}x)")  # fmt: skip
        zbv = f"{r['of_zb_v_rate']:.2f}x" if "of_zb_v_rate" in r else "-"
        lines.append([
            r["k"], r["m"], r["schedule"], str(r["balance"]), f"{r['held']}",
            f"{format_bytes(r['peak'])} ({format_bytes(r['peak_predicted'])}, {err:+.1%})",
            f"{r['of_1f1b_memory']:.2f}x", budget, f"{r['median']:.1f}", f"{r['spread']:.0%}",
            f"{r['of_1f1b_rate']:.2f}x ({lo:.2f}-{hi:.2f})", zbv,
        ])  # fmt: skip
    headers = ["K", "M", "schedule", "balance", "held (stage micro-batches per device)",
               "activation peak measured (predicted, error)", "x 1F1B memory",
               "budget (measured peak / budget)", "samples/s median", "spread p10-p90",
               "x 1F1B rate (90% interval)", "x ZB-V rate"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    if args.ranks:
        return _main_ranks(args)
    before = common.load()
    work = common.workload("gpt", quick=args.quick)
    rows = [r for k in args.workers for r in measure(work, k, args.chunks, args)]
    text = table(rows)
    note = (
        f"Job: {work.description}, cross-entropy, Adam state counted, checkpoint='never', "
        f"M={args.chunks}; balance by forward FLOPs. {args.rounds} rounds x "
        f"{math.ceil(args.steps / args.rounds)} timed steps per schedule after one untimed "
        "step per block, order rotating. Activation peak: the device's measured peak "
        "(pipepar.planner.measure.measure_device) less its parameters, gradients and Adam "
        "state, the largest over the devices; predicted: the planner's MemoryModel for that "
        "device. Held: the most stage micro-batches a device holds at once (1F1B: full "
        "stages; the V schedules and auto: half stages). auto@N%: schedule='auto', "
        "memory_budget='N%' over 2K stages (N% of 1F1B's micro-batches); bytes@N%: "
        "schedule='auto', memory_budget= N% of 1F1B's predicted activation peak in bytes; "
        "the budget column is N% of 1F1B's measured activation peak, beside it the measured "
        "peak over that budget. x ZB-V rate: the median rate "
        "over ZB-V's. The 2-core machine is shared with other "
        f"jobs: machine load before {before}; after {common.load()}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        title = TITLE_AUTO if args.budgets or args.byte_budgets else TITLE
        record(title, text, notes=note, path=common.results_path(args, "vschedules"))
    common.write_json(args.json, rows)
    return 0


def _main_ranks(args: argparse.Namespace) -> int:
    """The rates across ranks: one table per run, each K of --workers its rows."""
    before = common.load()
    work = common.workload("gpt", quick=args.quick)
    parts = [rank_table(k, args.chunks, against_1f1b(rank_rates(k, args.chunks, args)))
             for k in args.workers]  # fmt: skip
    text = "\n\n".join(parts)
    note = (
        f"Job: {work.description}, cross-entropy, no optimizer, checkpoint='never', "
        f"M={args.chunks}; pipepar.distributed.wrap on K spawned gloo ranks (one stage per "
        "rank for 1F1B, two for the V schedules), balance by forward FLOPs. "
        f"{args.rounds} rounds x {math.ceil(args.steps / args.rounds)} timed steps per "
        "schedule after one untimed step per block, order rotating; a step's time is the "
        "slowest rank's, every step started after a barrier. The 2-core machine is shared "
        f"with other jobs: machine load before {before}; after {common.load()}."
    )
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE_RANKS, text, notes=note, path=common.results_path(args, "vschedules"))
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=6)
    common.add_schedule_options(parser)
    parser.add_argument("--ranks", action="store_true", help="rates across spawned ranks only")
    parser.add_argument(
        "--budgets", type=lambda t: [float(x) for x in t.split(",")], default=[],
        help="shares of 1F1B's micro-batches for schedule='auto', e.g. 0.33,0.5,0.75,1",
    )  # fmt: skip
    parser.add_argument(
        "--byte-budgets", type=lambda t: [float(x) for x in t.split(",")], default=[],
        help="shares of 1F1B's predicted activation bytes for schedule='auto', e.g. 0.5,1",
    )  # fmt: skip
    parser.add_argument(
        "--schedules", type=lambda t: tuple(t.split(",")), default=None,
        help=f"named schedules, 1f1b first (default {','.join(SCHEDULES)})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.schedules = args.schedules or (QUICK if args.quick else SCHEDULES)
    args.schedules = (*args.schedules, *(f"{AUTO}{round(100 * b)}%" for b in args.budgets),
                      *(f"{BYTES}{round(100 * b)}%" for b in args.byte_budgets))  # fmt: skip
    if args.quick:
        args.rounds, args.steps, args.workers, args.chunks = 1, 2, [2], 4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
