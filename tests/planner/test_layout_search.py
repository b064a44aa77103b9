"""The layout search against brute force, its capacity checks, the API and the command line."""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import models
import pipepar
from pipepar.cli.main import main
from pipepar.core.named_schedules import NAMES, VIRTUAL
from pipepar.core.units import parse_bytes
from pipepar.planner.cluster import Cluster, Link
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layout import Layout, layouts_json
from pipepar.planner.layout_search import CHUNKS
from pipepar.planner.peak_moments import schedule_for
from pipepar.planner.profile import Profile
from pipepar.planner.stage_memory import MemoryModel
from pipepar.planner.step_time import predict_step
from pipepar.render.layout_table import balance_text, render_layouts
from pipepar.render.report import render_report
from tests.planner._clusters import cluster

CHECKPOINTS = ("never", "except_last", "always")
Flops = list[tuple[float, float]]


def _cluster(link: Link) -> Cluster:
    return cluster(link=link)


SLOW = _cluster(Link(bandwidth=1e9, latency=1e-5))
FREE = _cluster(Link(bandwidth=1e30, latency=0.0))
WIDTH = 32


def _mlp() -> nn.Sequential:
    return models.mlp(depth=3, width=WIDTH)  # 6 layers: Linear, ReLU, ...


def _profile(model: nn.Module, rows: int) -> tuple[Profile, Flops]:
    x = torch.randn(rows, WIDTH)
    prof = pipepar.profile(model, x)
    return prof, count_flops(model, x, prof)


def _timed(model: nn.Module, rows: int, cluster: Cluster) -> tuple[Profile, Flops]:
    """A profile of ``rows`` rows (taken at that size, not scaled), timed by its FLOPs."""
    prof, flops = _profile(model, rows)
    rate = cluster.flops * cluster.efficiency / 1e3
    layers = [
        replace(x, forward_ms=f / rate, backward_ms=b / rate)
        for x, (f, b) in zip(prof.layers, flops)
    ]
    return replace(prof, layers=layers), flops


def _options(prof: Profile, devices: int, batch: int):  # type: ignore[no-untyped-def]
    """Every (pp, dp, rows, schedule, chunks, checkpoint) of ``devices`` devices."""
    for pp in (d for d in range(1, devices + 1) if devices % d == 0):
        dp = devices // pp
        for name in NAMES:
            if pp * (2 if name in VIRTUAL else 1) <= len(prof):
                for m, checkpoint in itertools.product(CHUNKS, CHECKPOINTS):
                    if m <= batch // dp:
                        yield pp, dp, batch // dp, name, m, checkpoint


def _every_layout(model: nn.Module, devices: int, batch: int, capacity: int):  # type: ignore[no-untyped-def]
    """Brute force: every option planned with pipepar.plan (the balance the search uses), the
    memory checked on its plan and its step predicted, replicated and (dp >= 2) sharded over
    the replicas; (step, pp, schedule, chunks, checkpoint, sharded)."""
    profiles = {}
    found = []
    for pp, dp, rows, name, m, checkpoint in _options(_profile(model, 1)[0], devices, batch):
        if rows not in profiles:
            profiles[rows] = _timed(model, rows, SLOW)
        prof, flops = profiles[rows]
        for shard in (False, True) if dp > 1 else (False,):
            try:
                p = pipepar.plan(
                    prof,
                    devices=pp,
                    capacity=capacity,
                    chunks=m,
                    schedule=name,
                    checkpoint=checkpoint,
                    shard=dp if shard else 1,
                )
            except ValueError:
                continue
            assert p.peak_bytes <= capacity
            pred = predict_step(
                prof,
                p.balance,
                cluster=SLOW,
                schedule=name,
                chunks=m,
                checkpoint=checkpoint,
                dp=dp,
                flops=flops,
                dp_shard=shard,
            )
            found.append((pred.step_ms, pp, name, m, checkpoint, shard))
    return sorted(found)


@functools.cache
def _brute_force(capacity: int):  # type: ignore[no-untyped-def]
    """:func:`_every_layout` of the MLP on 4 devices, batch 64: found once per capacity for
    the tests that share it (profiles hold shapes, bytes and FLOPs, not the weights' values)."""
    return _every_layout(_mlp(), 4, 64, capacity)


def _key(x: Layout) -> tuple[object, ...]:
    return (x.pp, x.schedule, x.chunks, x.checkpoint, x.dp_shard)


# -- against brute force -----------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [2**30, 60_000, 45_000, 32_000])
def test_search_finds_what_brute_force_finds(capacity: int) -> None:
    """Every option tried by hand, replicated and sharded: the search returns the same layouts
    with the same predicted steps, all of them (top=None) and the fastest three (its pruning
    loses none of those)."""
    brute = _brute_force(capacity)
    assert brute, "the case must have layouts that fit"
    prof, flops = _profile(_mlp(), 8)  # scaled to each replica's rows by the search
    # brute force plans without activation offload (pipepar.plan has no offload)
    options = dict(
        devices=4, batch=64, cluster=SLOW, capacity=capacity, flops=flops, offloads=(False,)
    )
    replicated = pipepar.search_layouts(prof, **options, top=None, shards=(False,))  # type: ignore[arg-type]
    assert {_key(x): x.step_ms for x in replicated} == pytest.approx(
        {(pp, name, m, c, shard): step for step, pp, name, m, c, shard in brute if not shard}
    )
    every = pipepar.search_layouts(prof, **options, top=None)  # type: ignore[arg-type]
    found = {_key(x): x.step_ms for x in every}
    steps = {(pp, name, m, c, shard): step for step, pp, name, m, c, shard in brute}
    assert found == pytest.approx({key: steps[key] for key in found})
    # The micro-batch prune is a trend, not a proof (module docstring): at 60 kB it leaves out
    # sharded GPipe layouts on one device whose fewer micro-batches fit where more did not.
    assert len(found) >= len(steps) - 3
    best = pipepar.search_layouts(prof, **options, top=3)  # type: ignore[arg-type]
    assert [x.step_ms for x in best] == pytest.approx([step for step, *_ in brute[:3]])
    assert [x.step_ms for x in every[:3]] == pytest.approx([x.step_ms for x in best])


def test_the_brute_force_optimum_is_sharded_at_some_capacities() -> None:
    """Sharding is a real candidate: at 45 kB the fastest layouts shard their replicas' state,
    and the search picks the one brute force does."""
    brute = _brute_force(45_000)
    assert brute[0][-1] is True and any(not shard for *_, shard in brute)
    prof, flops = _profile(_mlp(), 8)
    best = pipepar.search_layouts(
        prof, devices=4, batch=64, cluster=SLOW, capacity=45_000, flops=flops, top=1,
        offloads=(False,),
    )[0]  # fmt: skip
    assert best.dp_shard and _key(best) == (*brute[0][1:5], True)
    assert best.step_ms == pytest.approx(brute[0][0]) and best.prediction.dp_shard


def test_brute_force_tight_capacities_leave_some_out() -> None:
    """The capacities above rule some layouts out, and recompute and chunks matter to which."""
    loose = _brute_force(2**30)
    tight = _brute_force(45_000)
    assert len(tight) < len(loose) / 2
    assert {c for *_, c, _ in tight} == set(CHECKPOINTS)
    assert {m for *_, m, _, _ in tight} != set(CHUNKS)


@pytest.mark.parametrize("cluster", [FREE, SLOW], ids=["free-links", "slow-links"])
def test_balance_is_the_fastest_of_every_split(cluster: Cluster) -> None:
    """With every balance of equal layers tried too, none beats the search's best."""
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    best = float("inf")
    profiles = {}
    for pp, dp, rows, name, m, checkpoint in _options(_profile(model, 1)[0], 4, 16):
        if rows not in profiles:
            profiles[rows] = _timed(model, rows, cluster)
        prof, flops = profiles[rows]
        stages = pp * (2 if name in VIRTUAL else 1)
        for cuts in itertools.combinations(range(1, len(prof)), stages - 1):
            balance = [b - a for a, b in zip((0, *cuts), (*cuts, len(prof)))]
            pred = predict_step(
                prof,
                balance,
                cluster=cluster,
                schedule=name,
                chunks=m,
                checkpoint=checkpoint,
                dp=dp,
                flops=flops,
            )
            best = min(best, pred.step_ms)
    prof, flops = _profile(model, 4)
    found = pipepar.search_layouts(prof, devices=4, batch=16, cluster=cluster, flops=flops, top=1)
    assert found[0].step_ms == pytest.approx(best)


# -- capacity ----------------------------------------------------------------------------------
def test_no_layout_over_capacity() -> None:
    """Every device of every layout fits, by the layout's own figures and by a memory model
    built again from its plan."""
    prof, flops = _profile(_mlp(), 8)
    layouts = pipepar.search_layouts(
        prof, devices=4, batch=64, cluster=SLOW, capacity=40_000, flops=flops, top=None
    )
    assert layouts
    for x in layouts:
        assert max(x.peak_bytes) <= 40_000 == x.capacity_bytes
        order = schedule_for(x.schedule, x.pp, x.chunks)
        memory = MemoryModel(x.plan.profile, order, checkpoint=x.checkpoint, foreach=[True] * x.pp)
        for w in range(x.pp):
            ranges = [
                (x.plan.stages[s].layers.start, x.plan.stages[s].layers.stop - 1)
                for s in order.stages_of(w)
            ]
            assert sum(m.peak_bytes for m in memory.device(w, ranges)) == x.peak_bytes[w]


def test_too_small_a_capacity_names_the_least_needed() -> None:
    """Nothing fits: the message names about the capacity that does, and it does."""
    prof, flops = _profile(_mlp(), 8)
    with pytest.raises(ValueError, match="no layout fits 4 devices of") as err:
        pipepar.search_layouts(prof, devices=4, batch=64, cluster=SLOW, capacity=5_000, flops=flops)
    found = re.search(r"the least any needs is about ([\d.]+) (\w+) per device", str(err.value))
    assert found, err.value
    need = parse_bytes(found.group(1) + found.group(2))
    assert "pp=4" in str(err.value) and "checkpoint='always'" in str(err.value)
    fits = pipepar.search_layouts(
        prof, devices=4, batch=64, cluster=SLOW, capacity=int(need * 1.01), flops=flops
    )
    assert fits and max(fits[0].peak_bytes) <= need * 1.01


def test_nothing_to_try_says_why() -> None:
    """No pp x dp can run: each reason is named."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    prof, flops = _profile(model, 4)
    with pytest.raises(ValueError) as err:
        pipepar.search_layouts(prof, devices=3, batch=4, cluster=SLOW, flops=flops)
    message = str(err.value)
    assert "dp=3: does not divide the batch of 4 rows" in message
    assert "pp=3: more devices than the 2 layers" in message


# -- the API -----------------------------------------------------------------------------------
def test_layouts_are_ranked_data_with_their_plan_and_prediction() -> None:
    prof, flops = _profile(_mlp(), 8)
    layouts = pipepar.search_layouts(
        prof, devices=4, batch=64, cluster=SLOW, capacity="1MiB", flops=flops, top=5
    )
    assert len(layouts) == 5
    assert [x.throughput for x in layouts] == sorted((x.throughput for x in layouts), reverse=True)
    for x in layouts:
        assert isinstance(x, pipepar.Layout) and x.pp * x.dp == 4 and x.rows * x.dp == 64
        assert len(x.balance) == x.pp * (2 if x.schedule in VIRTUAL else 1)
        assert sum(x.balance) == len(prof) and list(x.balance) == x.plan.balance
        assert x.throughput == pytest.approx(64 / (x.step_ms / 1e3))
        assert x.plan.prediction is x.prediction and x.prediction.dp == x.dp
        assert x.plan.profile.batch_size == x.rows and x.plan.chunks == x.chunks
        data = x.plan.to_dict()
        assert data["prediction"]["step_ms"] == x.step_ms and data["config"]["chunks"] == x.chunks
        assert json.loads(json.dumps(data))["prediction"]["stages"][0]["first_layer"] == 0
        assert x.to_dict()["balance"] == list(x.balance)
    text = render_report(layouts[0].plan)
    assert "predicted step on test (dp=" in text and "times from FLOPs" in text
    assert "predicted step on test" in pipepar.report.html(layouts[0].plan)
    table = render_layouts(layouts)
    assert "Layouts, fastest first (4 devices of 1.0 MiB, 64 rows per step, test)" in table
    assert table.count(" rows/s") == 1 and all(x.schedule in table for x in layouts)
    data = json.loads(layouts_json(layouts))
    assert data["format"] == "pipepar.layouts" and len(data["layouts"]) == 5
    assert data["plan"]["balance"] == list(layouts[0].balance)


def test_a_model_and_its_profile_search_alike() -> None:
    """A model is profiled and its FLOPs counted; the same as passing both."""
    model, sample = _mlp(), torch.randn(8, WIDTH)
    prof, flops = _profile(model, 8)
    options = dict(devices=4, batch=32, cluster=SLOW, capacity="1MiB", top=3)
    from_model = pipepar.search_layouts(model, sample, **options)  # type: ignore[arg-type]
    from_profile = pipepar.search_layouts(prof, flops=flops, **options)  # type: ignore[arg-type]
    assert [str(x) for x in from_model] == [str(x) for x in from_profile]


def test_a_plan_without_a_prediction_reads_as_before() -> None:
    p = pipepar.plan(_mlp(), torch.randn(8, WIDTH), devices=2, chunks=2)
    assert p.prediction is None and p.to_dict()["prediction"] is None
    assert "predicted step" not in render_report(p)


def test_a_named_cluster_grows_to_the_devices() -> None:
    prof, flops = _profile(_mlp(), 8)
    layouts = pipepar.search_layouts(prof, devices=16, batch=32, cluster="h100x8", flops=flops)
    assert layouts[0].prediction.cluster == "h100x8" and layouts[0].capacity_bytes == 80 * 10**9


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"devices": 0}, ValueError, "devices must be an int >= 1"),
        ({"batch": 0}, ValueError, "batch must be an int >= 1"),
        ({"top": 0}, ValueError, "top must be an int >= 1"),
        ({"chunks": []}, TypeError, "chunks must be a non-empty list"),
        ({"chunks": [4, 0]}, ValueError, r"chunks\[1\] must be an int >= 1"),
        ({"schedules": ["fast"]}, ValueError, "schedules has 'fast'"),
        ({"checkpoints": "always"}, TypeError, "checkpoints must be a non-empty list"),
        ({"cluster": 3}, TypeError, "cluster must be a Cluster or a preset name"),
        ({"cluster": "tpu"}, ValueError, "no cluster preset named 'tpu'"),
        ({"cluster": replace(SLOW, nodes=1)}, ValueError, r"replace\(cluster, nodes=2\)"),
        ({"flops": None}, ValueError, "the profile .on meta. has no layer times"),
        ({"flops": [(1.0, 2.0)]}, ValueError, "flops has 1 entries but the profile has 6"),
        ({"capacity": "lots"}, ValueError, "capacity"),
    ],
)
def test_bad_arguments_say_how_to_fix_them(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    prof, flops = _profile(_mlp(), 8)
    given = dict(devices=4, batch=32, cluster=SLOW, flops=flops) | options
    with pytest.raises(error, match=message):
        pipepar.search_layouts(prof, **given)  # type: ignore[arg-type]


def test_balance_text() -> None:
    assert balance_text([5, 5, 6]) == "[5, 5, 6]"
    assert balance_text([5] * 15 + [6]) == "16 stages of 5-6"
    assert balance_text([3] * 12) == "12 stages of 3"


# -- the command line --------------------------------------------------------------------------
def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


GPT2 = ["plan", "models.transformers_zoo:gpt2", "--tokens", "4,16", "--devices", "4"]


def test_cli_searches_the_whole_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "layouts.json"
    code, out, err = _run(
        capsys,
        *GPT2,
        "--capacity",
        "1GiB",
        "--cluster",
        "h100x8",
        "--batch",
        "8",
        "--top",
        "3",
        "--json",
        str(js),
    )
    assert code == 0, err
    assert "Layouts, fastest first (4 devices of 1.0 GiB, 8 rows per step, h100x8)" in out
    assert "predicted step on h100x8 (dp=" in out and "Stages (" in out
    data = json.loads(js.read_text())
    assert data["format"] == "pipepar.layouts" and 1 <= len(data["layouts"]) <= 3
    first = data["layouts"][0]
    assert first["pp"] * first["dp"] == 4 and data["plan"]["balance"] == first["balance"]
    assert data["plan"]["prediction"]["step_ms"] == first["step_ms"]
    for row in data["layouts"]:
        assert max(row["peak_bytes"]) <= row["capacity_bytes"] == 2**30


def test_cli_searches_a_model_that_is_not_a_transformer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torchvision-style model (no transformers config to read a dtype from), with the
    HTML report of the best layout."""
    page = tmp_path / "best.html"
    code, out, err = _run(
        capsys, "plan", "models.alexnet", "--input-shape", "8,3,64,64", "--devices", "4",
        "--capacity", "1GiB", "--cluster", "a100x8", "--batch", "8", "--top", "2",
        "--html", str(page),
    )  # fmt: skip
    assert code == 0, err
    assert "Layouts, fastest first (4 devices of 1.0 GiB, 8 rows per step, a100x8)" in out
    assert "Predicted pipeline timeline" in page.read_text()


def test_cli_search_offload_yes_offloads_every_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "layouts.json"
    # 4 rows: what --offload does to a search does not depend on the batch (a smaller one has
    # fewer micro-batch counts to try)
    options = ["--capacity", "1GiB", "--cluster", "h100x8", "--batch", "4", "--top", "2"]
    code, out, err = _run(capsys, *GPT2, *options, "--offload", "yes", "--json", str(js))
    assert code == 0, err
    assert all(row["offload"] for row in json.loads(js.read_text())["layouts"])
    assert "offload" in out
    code, out, err = _run(capsys, *GPT2, *options, "--offload", "no", "--json", str(js))
    assert code == 0, err
    assert not any(row["offload"] for row in json.loads(js.read_text())["layouts"])
    on_cpus = [*options[:2], "--cluster", "cpu", *options[4:]]  # asked for: priced there too
    code, out, err = _run(capsys, *GPT2, *on_cpus, "--offload", "yes", "--json", str(js))
    assert code == 0, err
    assert all(row["offload"] for row in json.loads(js.read_text())["layouts"])
    assert _run(capsys, *GPT2, "--offload", "no")[0] == 2  # not a layout search


def test_cli_search_with_nothing_fitting_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys, *GPT2, "--capacity", "1KiB", "--cluster", "h100x8", "--batch", "16"
    )
    assert code == 1 and out == "" and "the least any needs is about" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cluster", "h100x8"], "--cluster and --batch go together"),
        (["--batch", "16"], "--cluster and --batch go together"),
        (["--cluster", "tpu", "--batch", "16"], "no cluster preset named 'tpu'"),
        (["--cluster", "h100x8", "--batch", "0"], "--batch 0 must be at least 1"),
        (["--cluster", "h100x8", "--batch", "16", "--capacity", "1GiB,2GiB"], "one --capacity"),
    ],
)
def test_cli_search_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *GPT2, *extra)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1
