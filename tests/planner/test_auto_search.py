"""The layout search with ``"auto"`` among its schedules: where no named schedule fits a
pipeline at some micro-batch count, the order built for the capacity each device has left
does, its recorded action lists the ones predicted; the pipe built from that layout trains as
the plain model; where the named schedules fit comfortably, nothing changes.

The search runs on a profile on meta: its choice is the planner's arithmetic."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES
from pipepar.planner.cluster import cluster_for
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layout import Layout
from pipepar.planner.stage_memory import MemoryModel
from pipepar.planner.step_time import predict_step

WIDTH, ROWS, M, DEVICES = 64, 1024, 8, 4
CAPACITY = 500_000  # 4 devices, 8 micro-batches, no recompute: no named schedule fits
FIXED = {"chunks": M, "checkpoint": "never"}
CPUS = cluster_for(torch.device("cpu"), DEVICES)


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def _search(schedules: list[str], capacity: int, **options: object) -> list[Layout]:
    """Every layout of the chain on 4 CPU devices that fits, planned on meta; none: []."""
    x, _ = _batch()
    prof = pipepar.profile(_chain(), x, optimizer=None)
    flops = count_flops(_chain(), x, prof)
    try:
        return pipepar.search_layouts(
            prof, devices=DEVICES, batch=ROWS, cluster=CPUS, capacity=capacity, optimizer=None,
            flops=flops, schedules=schedules, top=None, **options,  # type: ignore[arg-type]
        )  # fmt: skip
    except ValueError:
        return []


def _one_pipeline(layouts: list[Layout]) -> list[Layout]:
    return [x for x in layouts if x.pp == DEVICES]


def test_where_no_named_schedule_fits_the_search_builds_one_that_does() -> None:
    fixed = {"chunks": [M], "checkpoints": ["never"], "shards": [False]}
    assert not _one_pipeline(_search(list(NAMES), CAPACITY, **fixed))
    found = _one_pipeline(_search([*NAMES, "auto"], CAPACITY, **fixed))
    assert [x.schedule for x in found] == ["auto"]
    layout = found[0]
    order = layout.order
    assert order is not None and order.name == "auto" and order.n_workers == DEVICES
    assert order.n_stages == len(layout.balance) == 2 * DEVICES
    assert max(layout.peak_bytes) <= CAPACITY and layout.plan.schedule == "auto"
    # the recorded order is the one whose memory and step were predicted
    memory = MemoryModel(layout.plan.profile, order, checkpoint="never",
                         foreach=[False] * DEVICES)  # fmt: skip
    starts = [sum(layout.balance[:s]) for s in range(order.n_stages)]
    ranges = [(a, a + n - 1) for a, n in zip(starts, layout.balance)]
    peaks = [
        sum(p.peak_bytes for p in memory.device(w, [ranges[s] for s in order.stages_of(w)]))
        for w in range(DEVICES)
    ]
    assert tuple(peaks) == layout.peak_bytes
    step = predict_step(
        layout.plan.profile, list(layout.balance), cluster=CPUS, schedule=order, chunks=M,
        checkpoint="never", flops=None,
    )  # fmt: skip
    assert step.step_ms == pytest.approx(layout.step_ms, rel=0.5)
    assert [a.to_dict() for a in layout.prediction.actions] and layout.prediction.schedule == "auto"
    # as distributed.wrap(plan="auto") sends it from group rank 0 to every rank
    assert pickle.loads(pickle.dumps(layout)).pipe_schedule.actions == order.actions


def test_where_the_named_schedules_fit_comfortably_nothing_changes() -> None:
    options = {"chunks": [2, 4, 8], "shards": [False]}
    named = _search(list(NAMES), 2**30, **options)
    with_auto = _search([*NAMES, "auto"], 2**30, **options)
    assert named and [str(x) for x in with_auto] == [str(x) for x in named]
    assert [x.balance for x in with_auto] == [x.balance for x in named]


def test_the_pipe_built_from_an_auto_layout_trains_as_the_plain_model() -> None:
    x, y = _batch()
    devices = ["cpu"] * DEVICES
    with pytest.raises(ValueError, match=r"no layout (with dp=1 .*)?fits"):
        pipepar.wrap(_chain(), sample=x, devices=devices, capacity=CAPACITY, **FIXED)  # type: ignore[arg-type]
    plain = _chain()
    pipe = pipepar.wrap(copy.deepcopy(plain), sample=x, devices=devices, capacity=CAPACITY,
                        schedule="auto", **FIXED)  # type: ignore[arg-type]  # fmt: skip
    layout = pipe.layout
    assert layout.schedule == "auto" and max(layout.peak_bytes) <= CAPACITY
    assert layout.order is not None and pipe.schedule.actions == layout.order.actions
    plain_loss = nn.functional.mse_loss(plain(x), y)
    plain_loss.backward()
    got = [pipe.step(x, y, nn.functional.mse_loss)] + [p.grad for p in pipe.parameters()]
    want = [plain_loss.detach()] + [p.grad for p in plain.parameters()]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_memory_budget_with_a_searched_layout_names_the_fix() -> None:
    x, _ = _batch()
    with pytest.raises(ValueError, match=r"memory_budget='50%'.*capacity=\.\.\. without it"):
        pipepar.wrap(_chain(), sample=x, devices=2, schedule="auto", memory_budget="50%")
