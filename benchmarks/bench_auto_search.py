"""What ``"auto"`` adds to the layout search: the search of the tests' MLP with the named
schedules, and with ``"auto"`` among them, and the budget search
(:func:`pipepar.core.schedule_budget.budget_schedule`) inside it, each in CPU seconds (this
process's; the machine is shared, so its wall time says little).

The job is ``tests/planner/test_auto_search.py``'s: 8 x (Linear(64, 64), GELU), 1024 rows,
4 CPU devices of 500 kB (where no named schedule fits a pipeline of 4 at 8 micro-batches),
profiled on meta. ``--options fixed`` searches that test's choices (8 micro-batches, no
recompute, replicated); ``default`` every micro-batch count, recompute policy and sharding.
Each search runs in a fresh process, so nothing built by one is reused by the next.

    python benchmarks/bench_auto_search.py --options fixed,default --write
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import markdown_table, record  # noqa: E402

_JOB = textwrap.dedent("""
    import json, sys, time
    import torch
    from torch import nn
    import pipepar
    import pipepar.planner.auto_fit as auto_fit
    from pipepar.core.named_schedules import NAMES
    from pipepar.planner.cluster import cluster_for
    from pipepar.planner.flop_count import count_flops

    options, schedules = sys.argv[1], sys.argv[2]
    spent = [0.0, 0]
    budget_schedule = auto_fit.budget_schedule
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return budget_schedule(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - start
            spent[1] += 1
    auto_fit.budget_schedule = timed
    def chain():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.GELU())])
    torch.manual_seed(1)
    x = torch.randn(1024, 64)
    prof = pipepar.profile(chain(), x, optimizer=None)
    flops = count_flops(chain(), x, prof)
    fixed = {"chunks": [8], "checkpoints": ["never"], "shards": [False]}
    start = time.process_time()
    layouts = pipepar.search_layouts(
        prof, devices=4, batch=1024, cluster=cluster_for(torch.device("cpu"), 4),
        capacity=500_000, optimizer=None, flops=flops, top=None,
        schedules=list(NAMES) + (["auto"] if schedules == "auto" else []),
        **(fixed if options == "fixed" else {}))
    print(json.dumps({"search": time.process_time() - start, "budget": spent[0],
                      "calls": spent[1], "layouts": len(layouts),
                      "auto": sum(x.schedule == "auto" for x in layouts)}))
""")


def run(options: str, schedules: str) -> dict[str, float]:
    """One search in a fresh process: its CPU seconds, the budget search's, the layouts."""
    done = subprocess.run(
        [sys.executable, "-c", _JOB, options, schedules],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="fixed", help="fixed and/or default, by commas")
    parser.add_argument("--write", action="store_true", help="the section in RESULTS.md")
    args = parser.parse_args(argv)
    rows = []
    for options in args.options.split(","):
        named, auto = run(options, "named"), run(options, "auto")
        calls = int(auto["calls"])
        rows.append([
            options,
            f"{named['search']:.2f}",
            f"{auto['search']:.2f}",
            calls,
            f"{auto['budget']:.2f}",
            f"{auto['budget'] / max(1, calls):.2f}",
            f"{int(named['layouts'])} / {int(auto['layouts'])} ({int(auto['auto'])} auto)",
        ])  # fmt: skip
    table = markdown_table(
        ["options", "named search CPU s", "with auto CPU s", "budget searches",
         "their CPU s", "CPU s each", "layouts named / with auto"],
        rows,
    )  # fmt: skip
    print(table)
    if args.write:
        record(
            "schedule='auto' in the layout search: what the budget search costs",
            table,
            notes="Job: the search of tests/planner/test_auto_search.py's MLP (8 x Linear(64) "
            "+ GELU, 1024 rows, 4 CPU devices of 500 kB, profiled on meta, top=None); fixed: "
            "M=8, no recompute, replicated; default: every count, recompute and sharding. CPU "
            "seconds of the searching process, each search in a fresh one.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
