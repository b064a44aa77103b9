"""What planning one stage's backward costs: reading its graph, or given the route check's walk.

Every split backward (B of a zero-bubble schedule) and every whole backward of a large stage
plans first: :func:`pipepar.core.split_backward.plan_backward` walks the stage's autograd
graph and finds its junctions and direct weight terms, once per stage and micro-batch. A
followed route's graph check has walked the same graph in the forward; the stage's planning
takes the next nodes that walk read (``known=``) instead of asking every node again.

The stage: the second half of ``bench_models``' GPT-2 or Llama (blocks 4-7, the final norm,
the head and the model's own loss, 16 x 64 tokens: its input is a leaf at block 4). Both ways
of planning are timed in this process, alternating in blocks, split (``reach=False``) and
whole (``reach=True``); each block's mean per plan is one sample. The table gives the median
and the p10-p90 spread over the blocks, and the given walk's time over the reading one's.

    python benchmarks/bench_backward_plan.py
    python benchmarks/bench_backward_plan.py --quick      # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor

from benchmarks import bench_models
from pipepar.core import split_backward


def stage_graph(name: str, quick: bool) -> tuple[list[Tensor], list[Tensor], dict[int, Tensor]]:
    """The loss of the model's second half, its input leaf and the parameters by ``id``."""
    work = bench_models.job(name, quick=quick)
    blocks = dict(work.model.named_modules())[bench_models.BLOCKS[name]]
    held: dict[str, Tensor] = {}

    def cut(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_()
        held["x"] = x
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    handle = blocks[work.layers // 2].register_forward_pre_hook(cut, with_kwargs=True)
    loss = work.model(input_ids=work.ids, labels=work.ids).loss
    handle.remove()
    return [loss], [held["x"]], split_backward.by_id(list(work.model.parameters()))


def samples(
    plan: Callable[[], object], blocks: int, per_block: int, other: Callable[[], object]
) -> tuple[list[float], list[float]]:
    """Per-plan microseconds of ``plan`` and ``other``, alternating blocks."""
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(blocks):
        for f, out in ((plan, mine), (other, theirs)):
            start = time.perf_counter()
            for _ in range(per_block):
                f()
            out.append((time.perf_counter() - start) / per_block * 1e6)
    return mine, theirs


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.0f} ({q[0]:.0f}-{q[-1]:.0f})"


def rows(name: str, quick: bool, blocks: int, per_block: int) -> list[str]:
    outputs, inputs, params = stage_graph(name, quick)
    grads = [torch.ones_like(t) for t in outputs]
    known = split_backward._Graph(outputs, inputs, params).nexts
    found = []
    for reach in (False, True):

        def read(reach: bool = reach) -> object:
            return split_backward.plan_backward(outputs, grads, inputs, params, reach=reach)

        def given(reach: bool = reach) -> object:
            return split_backward.plan_backward(
                outputs, grads, inputs, params, reach=reach, known=known
            )

        for _ in range(3):  # warm
            read(), given()
        reading, walked = samples(read, blocks, per_block, given)
        ratio = statistics.median(walked) / statistics.median(reading)
        kind = "whole" if reach else "split"
        found.append(
            f"| {name} | {kind} | {len(known)} | {spread(reading)} | {spread(walked)} "
            f"| {ratio:.2f} |"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    blocks, per_block = (5, 5) if args.quick else (args.blocks, 40)
    print(
        "| model | backward | nodes | reading the graph, us per plan median (p10-p90) "
        "| given the check's walk, us | given / reading |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models:
        for row in rows(name, args.quick, blocks, per_block):
            print(row, flush=True)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--blocks", type=int, default=21, help="alternating blocks of plans")
    parser.add_argument("--quick", action="store_true", help="tiny models, few blocks")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
