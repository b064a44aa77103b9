"""Peak memory per stage (GPipe, 1F1B, ZB-H1, checkpointing) and per device (interleaved 1F1B,
ZB-V), measured beside the planner's prediction, and the largest GPT-style stack that trains
within a fixed per-stage budget for K = 1, 2, 4.

The virtual-stage schedules (interleaved 1F1B, ZB-V) put two stages on each device: their table
is per device, both stages' actions run interleaved in the device's order of the schedule by
:func:`pipepar.planner.measure.measure_device`, beside the planner's prediction for the device.

Measured: each stage's layers run one training step (after a warm-up step) in the schedule's
order for that stage, with Adam, by :func:`pipepar.measure.measure_stage`; its peak is read from
the CPU allocator's events that ``torch.profiler`` records (``profile_memory=True``), plus the
resident parameters, optimizer state and (stage 0) the batch. That is independent of the
prediction, which comes from the planner's memory model
(:class:`pipepar.stage_memory.MemoryModel`) over a profile taken on the meta device.

The scaling table is the one the GPipe and torchgpipe papers show: for K stages of the same
budget, the deepest stack :func:`pipepar.plan` fits, then checked by measuring every stage.

    python benchmarks/bench_memory.py                  # writes benchmarks/RESULTS.md
    python benchmarks/bench_memory.py --quick --json rows.json   # seconds, temp results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import pipepar
from benchmarks import _common as common
from benchmarks._results import markdown_table, record
from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.core.units import format_bytes, parse_bytes
from pipepar.planner.measure import measure_device, measure_split
from pipepar.planner.stage_memory import MemoryModel

TITLE_MODES = "Memory per stage: GPipe vs 1F1B vs ZB-H1 vs checkpointing"
TITLE_SCALE = "Memory scaling: largest GPT stack within a per-stage budget"
TITLE_VIRTUAL = "Memory per device: virtual-stage schedules"
VIRTUAL_MODES = [
    ("1f1b", "never"),
    ("interleaved-1f1b", "never"),
    ("zb-v", "never"),
    ("1f1b", "except_last"),
    ("interleaved-1f1b", "except_last"),
    ("zb-v", "except_last"),
]
MODES = [
    ("gpipe", "never"),
    ("gpipe", "except_last"),
    ("gpipe", "always"),
    ("1f1b", "never"),
    ("1f1b", "except_last"),
    ("zb-h1", "never"),
    ("zb-h1", "always"),
]
OPTIMIZER = "adam"


def _gpt(depth: int, quick: bool, device: str = "cpu") -> tuple[nn.Sequential, Tensor]:
    """GPT stack of ``depth`` blocks and a seeded batch of token ids."""
    width, heads, vocab, seq, batch = (32, 2, 64, 16, 4) if quick else (128, 4, 512, 64, 16)
    torch.manual_seed(0)
    model = models.gpt(depth, width, heads, vocab, seq, device=device)
    ids = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, ids.to(device)


def predicted(
    prof: pipepar.Profile, balance: list[int], m: int, schedule: str, checkpoint: str
) -> list[int]:
    """The planner's predicted peak of every stage for this balance, each stage alone (the
    device's peak with one stage per device, as measured)."""
    k = len(balance)
    workers = k // 2 if schedule in VIRTUAL else k
    mm = MemoryModel(
        prof, make(schedule, k, m, n_workers=workers), checkpoint=checkpoint, foreach=[False] * k
    )
    return [mm.stage(j, a, b).peak_bytes for j, (a, b) in enumerate(common.stage_ranges(balance))]


def mode_rows(quick: bool) -> list[dict[str, Any]]:
    """Every schedule x checkpoint mode on one GPT stack, K=4 (2 in quick mode), same balance."""
    k, m, depth = (2, 4, 2) if quick else (4, 8, 8)
    model, x = _gpt(depth, quick)
    work = common.Workload("gpt", model, x, x, nn.functional.cross_entropy, "")
    bal = common.balance(work, k)
    prof = pipepar.profile(model, x, device="meta", optimizer=OPTIMIZER)
    rows = []
    for schedule, checkpoint in MODES:
        want = predicted(prof, bal, m, schedule, checkpoint)
        got = measure_split(
            model, x, bal, chunks=m, optimizer=OPTIMIZER, checkpoint=checkpoint, schedule=schedule
        )
        rows.append(_row(depth, k, m, bal, schedule, checkpoint, measured=got, predicted=want))
    return rows


def _row(
    depth: int, k: int, m: int, bal: list[int], schedule: str, checkpoint: str, **figures: Any
) -> dict[str, Any]:
    """One result row: the case and its figures."""
    case = {"depth": depth, "k": k, "m": m, "balance": bal, "schedule": schedule}
    return {**case, "checkpoint": checkpoint, **figures}


def virtual_rows(quick: bool) -> list[dict[str, Any]]:
    """Per-device measured and predicted peaks of the same GPT stack on K devices: 1F1B (one
    stage each) next to the two-stages-per-device schedules, each balanced by forward FLOPs."""
    k, m, depth = (2, 4, 2) if quick else (4, 8, 8)
    model, x = _gpt(depth, quick)
    work = common.Workload("gpt", model, x, x, nn.functional.cross_entropy, "")
    prof = pipepar.profile(model, x, device="meta", optimizer=OPTIMIZER)
    rows = []
    for schedule, checkpoint in VIRTUAL_MODES:
        n = 2 * k if schedule in VIRTUAL else k
        bal, order = common.balance(work, n), make(schedule, n, m, n_workers=k)
        mm = MemoryModel(prof, order, checkpoint=checkpoint, foreach=[False] * k)
        ranges = common.stage_ranges(bal)
        peaks = [
            sum(p.peak_bytes for p in mm.device(w, [ranges[s] for s in order.stages_of(w)]))
            for w in range(k)
        ]
        got = [
            measure_device(
                model,
                x,
                bal,
                device=w,
                chunks=m,
                optimizer=OPTIMIZER,
                checkpoint=checkpoint,
                schedule=order,
            )
            for w in range(k)
        ]
        held = [order.worker_in_flight(w) for w in range(k)]
        row = _row(depth, k, m, bal, schedule, checkpoint, measured=got, predicted=peaks)
        rows.append({**row, "held": held, "bubble": order.bubble()})
    return rows


def virtual_table(rows: list[dict[str, Any]]) -> str:
    """One line per schedule: each device's measured peak (predicted, error), the
    micro-batch-stages each device holds at most, and the bubble."""
    k = rows[0]["k"]
    lines = [
        [
            r["schedule"],
            r["checkpoint"],
            str(r["balance"]),
            *_cells(r),
            format_bytes(max(r["measured"])),
            ", ".join(str(h) for h in r["held"]),
            f"{r['bubble']:.1%}",
        ]
        for r in rows
    ]
    headers = [
        "schedule",
        "checkpoint",
        "balance",
        *(f"device {w} measured (predicted, error)" for w in range(k)),
        "max measured",
        "held per device",
        "bubble (unit costs)",
    ]
    return markdown_table(headers, lines)


def largest(k: int, budget: int, m: int, quick: bool, limit: int) -> dict[str, Any]:
    """The deepest GPT stack the planner fits on K stages of ``budget`` bytes, then measured."""

    def plan(depth: int) -> pipepar.Plan | None:
        model, x = _gpt(depth, quick, device="meta")
        try:
            return pipepar.plan(
                model,
                x,
                devices=k,
                capacity=budget,
                optimizer=OPTIMIZER,
                chunks=m,
                schedule="gpipe",
                checkpoint="except_last",
            )
        except ValueError:
            return None

    lo, hi = 0, limit + 1  # plan(lo) fits (or lo == 0), plan(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid) is not None else (lo, mid)
    best = plan(lo) if lo else None
    if best is None:
        return {"k": k, "depth": 0, "budget": budget}
    model, x = _gpt(lo, quick)
    got = measure_split(
        model,
        x,
        list(best.balance),
        chunks=best.chunks,
        optimizer=OPTIMIZER,
        checkpoint="except_last",
        schedule="gpipe",
    )
    return {
        "k": k,
        "depth": lo,
        "budget": budget,
        "balance": list(best.balance),
        "params": sum(p.numel() for p in model.parameters()),
        "predicted": [s.peak_bytes for s in best.stages],
        "measured": got,
        "at_limit": lo == limit,
    }


def _cells(row: dict[str, Any]) -> list[str]:
    """Each measured peak of a row with its prediction and the error."""
    return [
        f"{format_bytes(got)} ({format_bytes(want)}, {got / want - 1:+.0%})"
        for got, want in zip(row["measured"], row["predicted"])
    ]


def mode_table(rows: list[dict[str, Any]]) -> str:
    """One line per mode: each stage's measured peak (predicted, error)."""
    k = rows[0]["k"]
    lines = [
        [
            r["schedule"],
            r["checkpoint"],
            *_cells(r),
            format_bytes(max(r["measured"])),
        ]
        for r in rows
    ]
    headers = [
        "schedule",
        "checkpoint",
        *(f"stage {j} measured (predicted, error)" for j in range(k)),
        "max measured",
    ]
    return markdown_table(headers, lines)


def scale_table(rows: list[dict[str, Any]]) -> str:
    """One line per K: the deepest stack, its size, and the stages' measured peaks."""
    lines = []
    for r in rows:
        if not r["depth"]:
            lines.append([r["k"], 0, "-", "-", "-", "-", format_bytes(r["budget"])])
            continue
        worst = max(r["measured"])
        depth = f"{r['depth']}{'+ (search limit)' if r['at_limit'] else ''}"
        lines.append(
            [
                r["k"],
                depth,
                f"{r['params'] / 1e6:.2f}M",
                str(r["balance"]),
                format_bytes(max(r["predicted"])),
                format_bytes(worst),
                f"{format_bytes(r['budget'])} ({'fits' if worst <= r['budget'] else 'OVER'})",
            ]
        )
    headers = ["K", "blocks", "params", "balance", "max predicted", "max measured", "budget"]
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the three tables, print and record them; 0 on success."""
    args = _parse(argv)
    before = common.load()
    modes = mode_rows(args.quick)
    virtual = virtual_rows(args.quick)
    ks, m = ([1, 2], 2) if args.quick else ([1, 2, 4], 4)
    budget = parse_bytes(args.budget or ("1MiB" if args.quick else "64MiB"))
    scale = [largest(k, budget, m, args.quick, limit=12 if args.quick else 96) for k in ks]
    r = modes[0]
    path = common.results_path(args, "memory")
    size = "tiny GPT" if args.quick else "GPT 128 wide, 4 heads, vocab 512, 16 x 64 tokens"
    how = (
        "Measured: pipepar.measure.measure_stage, one training step of each stage after a "
        "warm-up, peak from torch.profiler's CPU allocator events plus resident parameters, "
        f"Adam state and (stage 0) the batch. Predicted: pipepar's MemoryModel over a meta "
        f"profile. Machine load: before {before}, after {common.load()}."
    )
    notes_modes = (
        f"{size}, {r['depth']} blocks, K={r['k']}, M={r['m']}, balance {r['balance']} "
        f"(equal forward FLOPs), Adam. {how}"
    )
    notes_scale = (
        f"{size}, Adam, GPipe with checkpoint='except_last', M={m}; budget "
        f"{format_bytes(budget)} per stage. Depth: the deepest the planner fits "
        f"(binary search); then every stage measured as above. {how}"
    )
    notes_virtual = (
        f"{size}, {r['depth']} blocks on K={r['k']} devices, M={r['m']}, Adam; balance by "
        "forward FLOPs over one stage per device (1F1B) or two (interleaved 1F1B: stages w and "
        "w+K; ZB-V: stages w and 2K-1-w). Measured: pipepar.planner.measure.measure_device, one "
        "training step of all the device's stages after a warm-up, their actions interleaved "
        "in the device's order of the schedule (a stage takes its same-device predecessor's "
        "outputs and hands it its input gradients), peak as above. Predicted: pipepar's "
        "MemoryModel walking the device's own action list. Held: the most micro-batch-stages "
        f"the device holds at once. Machine load: before {before}, after {common.load()}."
    )
    for title, text, notes in (
        (TITLE_MODES, mode_table(modes), notes_modes),
        (TITLE_VIRTUAL, virtual_table(virtual), notes_virtual),
        (TITLE_SCALE, scale_table(scale), notes_scale),
    ):
        print(f"## {title}\n\n{text}\n\n{notes}\n")
        record(title, text, notes=notes, path=path)
    common.write_json(
        args.json,
        [{"table": "modes", **x} for x in modes]
        + [{"table": "virtual", **x} for x in virtual]
        + [{"table": "scaling", **x} for x in scale],
    )
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=1)
    parser.add_argument("--budget", default=None, help="per-stage budget, e.g. 64MiB")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
