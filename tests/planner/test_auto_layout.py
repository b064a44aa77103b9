"""``pipepar.wrap(model, sample=x, devices=N)`` runs the layout the search chose: the values given
are fixed, the rest chosen; the pipe equals the plain model; bad input fails with the fix."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL, gpipe
from pipepar.core.schedule import parse
from pipepar.planner import auto_layout
from pipepar.planner import cluster as cluster_module
from pipepar.planner.auto_layout import (
    Given,
    capacity_bytes,
    choose_layout,
    given_schedule,
)
from pipepar.planner.cluster import cluster_for
from pipepar.planner.layout import Layout
from pipepar.planner.runtime_fit import RuntimeFit
from tests._small_models import Residual, tanh_stack

ROWS, WIDTH = 16, 12


def _sequential() -> nn.Sequential:
    return tanh_stack(WIDTH)


def _residual() -> nn.Module:
    return Residual(WIDTH, 3)


@pytest.fixture
def searched(monkeypatch: pytest.MonkeyPatch) -> list[list[Layout]]:
    """What each search returned, in order."""
    found: list[list[Layout]] = []
    real = auto_layout.search_layouts

    def spy(*args: Any, **kwargs: Any) -> list[Layout]:
        found.append(real(*args, **kwargs))
        return found[-1]

    monkeypatch.setattr(auto_layout, "search_layouts", spy)
    return found


def _schedule_name(pipe: Any) -> str:
    return str(pipe.schedule.name) if hasattr(pipe.schedule, "name") else str(pipe.schedule)


def _same_as_plain(make: Any, devices: Any, **kwargs: Any) -> Any:
    """Wrap a fresh model by its layout search; its outputs and gradients equal the plain
    model's; return the pipe's layout."""
    x = torch.randn(ROWS, WIDTH)
    plain, model = make(), make()
    pipe = pipepar.wrap(model, sample=x, devices=devices, **kwargs)
    try:
        got = pipe(x)
        weight = torch.randn_like(got)
        (got * weight).sum().backward()
    finally:
        if hasattr(pipe, "close"):
            pipe.close()
    expected = plain(x)
    (expected * weight).sum().backward()
    torch.testing.assert_close(got, expected)
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    return pipe


@pytest.mark.parametrize("make", [_sequential, _residual], ids=["sequential", "residual"])
@pytest.mark.parametrize("devices", [["cpu", "cpu"], 2], ids=["list", "count"])
def test_the_pipe_runs_the_searchs_first_layout(
    make: Any, devices: Any, searched: list[list[Layout]]
) -> None:
    pipe = _same_as_plain(make, devices)
    layout = pipe.layout
    assert len(searched) == 1 and layout is next(x for x in searched[0] if x.dp == 1)
    assert layout.pp == 2 and layout.dp == 1 and layout.rows == ROWS
    assert pipe.balance == list(layout.balance)
    assert pipe.chunks == layout.chunks and pipe.checkpoint == layout.checkpoint
    assert _schedule_name(pipe) == layout.schedule
    assert "pp=2 dp=1" in str(layout)


@pytest.mark.parametrize(
    "fixed",
    [
        {"chunks": 2},
        {"schedule": "1f1b"},
        {"checkpoint": "always"},
        {"schedule": "zb-v", "chunks": 4},
        {"schedule": "gpipe", "chunks": 4, "checkpoint": "except_last"},
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_values_given_are_fixed(fixed: dict[str, Any], searched: list[list[Layout]]) -> None:
    pipe = _same_as_plain(_sequential, ["cpu", "cpu"], **fixed)
    layout = pipe.layout
    assert layout is next(x for x in searched[0] if x.dp == 1)
    assert all(x.chunks == fixed.get("chunks", x.chunks) for x in searched[0])
    for name, value in fixed.items():
        assert getattr(layout, name) == value
    assert (pipe.chunks, pipe.checkpoint) == (layout.chunks, layout.checkpoint)
    assert _schedule_name(pipe) == layout.schedule


@pytest.mark.parametrize("schedule", NAMES)
def test_any_model_runs_each_schedule_the_search_may_choose(schedule: str) -> None:
    """The virtual-stage ones too: their balance lists two stages per device."""
    pipe = _same_as_plain(_residual, 2, schedule=schedule)
    stages = 4 if schedule in VIRTUAL else 2
    assert pipe.layout.schedule == schedule and len(pipe.layout.balance) == stages


@pytest.mark.skipif(torch.cuda.is_available(), reason="devices=None means the GPUs there")
def test_no_devices_means_one_cpu_stage() -> None:
    pipe = pipepar.wrap(_sequential(), sample=torch.randn(ROWS, WIDTH))
    assert (pipe.layout.pp, pipe.layout.dp, len(set(pipe.devices))) == (1, 1, 1)


def test_all_fixed_only_chooses_the_balance() -> None:
    """As before the search: chunks, schedule and checkpoint given, the balance planned."""
    pipe = pipepar.wrap(
        _sequential(),
        sample=torch.randn(ROWS, WIDTH),
        devices=["cpu", "cpu"],
        chunks=4,
        schedule="gpipe",
        checkpoint="except_last",
    )
    assert len(pipe.balance) == 2 and sum(pipe.balance) == 8
    assert pipe.layout.balance == tuple(pipe.balance) and pipe.chunks == 4


def test_a_schedule_object_fixes_its_name_and_micro_batches() -> None:
    pipe = pipepar.wrap(
        _sequential(), sample=torch.randn(ROWS, WIDTH), devices=2, schedule=gpipe(2, 4)
    )
    assert (pipe.layout.schedule, pipe.layout.chunks, pipe.chunks) == ("gpipe", 4, 4)
    assert given_schedule("1f1b", None) == ("1f1b", None)


def test_balance_or_split_given_keeps_todays_defaults() -> None:
    pipe = pipepar.wrap(_sequential(), [4, 4], devices=["cpu", "cpu"])
    assert pipe.layout is None and pipe.chunks == 1 and pipe.checkpoint == "except_last"
    assert _schedule_name(pipe) == "gpipe"
    model = _residual()
    pipe = pipepar.wrap(model, split=["blocks.2"], devices=["cpu", "cpu"])
    try:
        assert pipe.layout is None and pipe.chunks == 1 and pipe.checkpoint == "never"
        assert _schedule_name(pipe) == "gpipe"
    finally:
        pipe.close()


def test_data_parallel_layouts_from_flop_counts() -> None:
    """A model on meta is timed by its FLOPs; a dp given is kept."""
    with torch.device("meta"):
        model = _sequential()
    rows = 4  # a row per replica at dp=4: fewer micro-batch counts to search than ROWS has
    x = torch.empty(rows, WIDTH, device="meta")
    cluster = cluster_for(torch.device("cpu"), 4)
    for dp in (2, 4):
        layout = choose_layout(
            model, x, devices=4, given=Given(dp=dp), cluster=cluster, capacity=2**30
        )
        assert (layout.dp, layout.pp, layout.rows) == (dp, 4 // dp, rows // dp)
    free = choose_layout(model, x, devices=4, given=Given(), cluster=cluster, capacity=2**30)
    assert free.pp * free.dp == 4


def test_clusters_and_capacities() -> None:
    cpu = cluster_for(torch.device("cpu"), 4, per_node=2)
    assert (cpu.devices_per_node, cpu.nodes) == (2, 2)
    assert cluster_module._preset_named_in("NVIDIA H100 80GB HBM3") == "h100x8"
    assert cluster_module._preset_named_in("NVIDIA A100-SXM4-40GB") == "a100x8"
    assert cluster_module._preset_named_in("Tesla T4") is None
    assert capacity_bytes(["1GiB", None], 2, default=2**20) == 2**20
    assert capacity_bytes(None, 2, default=5) == 5
    with pytest.raises(ValueError, match="capacity has 1 entries but there are 2 devices"):
        capacity_bytes(["1GiB"], 2, default=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sample": None}, ValueError, "no sample was given; pass balance="),
        ({"chunks": 32}, ValueError, r"chunks=32 but the sample gives each replica 16 rows"),
        ({"schedule": "zigzag"}, ValueError, r"schedule='zigzag' is not one of \['gpipe'"),
        ({"checkpoint": "sometimes"}, ValueError, r"checkpoint must be one of .* got 'sometimes'"),
        ({"chunks": 0}, ValueError, r"chunks=0 must be an int >= 1"),
        ({"devices": 9}, ValueError, r"devices=9 asks for 9 stages but the model has 8 layers"),
        ({"devices": []}, ValueError, r"devices=\[\] names no device"),
        ({"capacity": "1KiB"}, ValueError, r"no layout fits 2 devices of 1.0 KiB.*short by"),
        ({"schedule": parse(["F0 B0"])}, ValueError, r"custom Schedule .* pass balance="),
        ({"schedule": gpipe(2, 4), "chunks": 2}, ValueError, r"chunks=2 but the schedule"),
    ],
)
def test_errors_name_the_argument_and_the_fix(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"sample": torch.randn(ROWS, WIDTH), "devices": ["cpu", "cpu"]}
    with pytest.raises(error, match=match):
        pipepar.wrap(_sequential(), **(args | kwargs))


def test_a_model_without_sample_names_split_and_balance() -> None:
    with pytest.raises(ValueError, match=r"no sample was given; pass split=\[module paths"):
        pipepar.wrap(_residual(), devices=["cpu", "cpu"])


def test_the_layout_pickles() -> None:
    """As it travels from the rank that chose it to the others."""
    pipe = pipepar.wrap(_sequential(), sample=torch.randn(ROWS, WIDTH), devices=2, chunks=2)
    assert pickle.loads(pickle.dumps(pipe.layout)).to_dict() == pipe.layout.to_dict()


def test_cpu_stages_are_profiled_with_the_threads_each_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two CPU stages share the machine's math threads: layer times are measured with a
    stage's share, and the caller's thread count is restored."""
    from pipepar.planner import auto_layout

    seen: list[int] = []

    def spy(*args: object, **kwargs: object) -> None:
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop after the profile's threads are seen")

    monkeypatch.setattr(auto_layout, "choose_layout", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with pytest.raises(RuntimeError, match="stop after"):
            pipepar.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), sample=torch.randn(8, 4),
                         devices=["cpu", "cpu"])  # fmt: skip
        assert seen == [2] and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("make", [_sequential, _residual], ids=["sequential", "any model"])
def test_a_runtime_fit_ranks_the_layouts(make: Any, searched: list[list[Layout]]) -> None:
    """The search predicts with the fit (with a second per action, as few micro-batches as
    possible, and a longer step than without it); the pipe runs the layout the fitted search
    chose, and still equals the plain model."""
    costly = RuntimeFit(action_ms=1e3)
    pipe = _same_as_plain(make, ["cpu", "cpu"], schedule="1f1b", checkpoint="never",
                          runtime=costly)  # fmt: skip
    assert next(x for x in searched[-1] if x.dp == 1) == pipe.layout  # one pipeline here
    assert pipe.layout.chunks == 1  # every action costs a second: as few as possible
    free = _same_as_plain(make, ["cpu", "cpu"], schedule="1f1b", checkpoint="never")
    assert pipe.layout.step_ms > free.layout.step_ms + 2 * 1e3  # at least F and B of a stage


def test_a_runtime_that_is_not_a_fit_names_the_fix() -> None:
    with pytest.raises(TypeError, match="runtime must be a RuntimeFit"):
        pipepar.wrap(_sequential(), sample=torch.randn(ROWS, WIDTH), devices=2, runtime=1.5)
