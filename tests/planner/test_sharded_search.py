"""The layout search with sharded data parallelism: sharded candidates, their memory, their
step, and the ranking's data (``Layout.dp_shard``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pipepar
from pipepar.cli.main import main
from pipepar.core.units import parse_bytes
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layout import layouts_json
from pipepar.planner.peak_moments import schedule_for
from pipepar.planner.profile import Profile
from pipepar.planner.profile_rows import at_rows
from pipepar.planner.sharded_state import sharded
from pipepar.planner.stage_memory import MemoryModel
from pipepar.planner.step_time import predict_step
from pipepar.render.layout_table import render_layouts
from tests.planner._clusters import cluster

Flops = list[tuple[float, float]]
EIGHT = cluster(per_node=2, nodes=4)
ONLY_SHARDED_FITS = parse_bytes("1.2MiB")
"""Two Linear(256, 256) with Adam on 8 devices: replicated, the least any layout needs is about
1.3 MiB per device (pp=2, dp=4); sharded over dp=4 about 1.1 MiB."""


def _heavy() -> tuple[Profile, Flops]:
    """Weights and Adam state dwarf the activations: sharding is what makes room."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    x = torch.randn(8, 256)
    prof = pipepar.profile(model, x)
    return prof, count_flops(model, x, prof)


def _search(capacity: int, **options: object) -> list[pipepar.Layout]:
    prof, flops = _heavy()
    given = dict(devices=8, batch=8, cluster=EIGHT, capacity=capacity, flops=flops) | options
    return pipepar.search_layouts(prof, **given)  # type: ignore[arg-type]


def test_only_sharding_fits_and_the_search_picks_it() -> None:
    with pytest.raises(ValueError, match=r"least any needs is about 1.3 MiB .*pp=2, dp=4, 1f1b"):
        _search(ONLY_SHARDED_FITS, shards=(False,))
    layouts = _search(ONLY_SHARDED_FITS, top=None)
    assert layouts and all(x.dp_shard and x.dp >= 2 for x in layouts)
    best = layouts[0]
    assert (best.pp, best.dp) == (2, 4) and best.prediction.dp_shard
    assert best.plan.profile.shard == 4 and max(best.peak_bytes) <= ONLY_SHARDED_FITS
    assert "pp=2 dp=4 sharded " in str(best)


def test_sharded_layouts_fit_by_a_memory_model_of_one_rank() -> None:
    """Every device of every sharded layout fits, by the layout's figures and by a memory model
    built again from the unsharded profile sharded over the layout's dp."""
    prof, _ = _heavy()
    layouts = _search(parse_bytes("1.6MiB"), top=None)
    assert {x.dp_shard for x in layouts} == {False, True}
    for x in layouts:
        assert max(x.peak_bytes) <= parse_bytes("1.6MiB") == x.capacity_bytes
        one_rank = sharded(at_rows(prof, x.rows), x.dp) if x.dp_shard else None
        assert x.plan.profile.shard == (x.dp if x.dp_shard else 1)
        if one_rank is None:
            continue
        for a, b in zip(one_rank.layers, x.plan.profile.layers):
            assert (a.params_bytes, a.grads_bytes, a.optimizer_bytes) == (
                b.params_bytes,
                b.grads_bytes,
                b.optimizer_bytes,
            )
        order = schedule_for(x.schedule, x.pp, x.chunks)
        memory = MemoryModel(x.plan.profile, order, checkpoint=x.checkpoint, foreach=[True] * x.pp)
        for w in range(x.pp):
            ranges = [
                (x.plan.stages[s].layers.start, x.plan.stages[s].layers.stop - 1)
                for s in order.stages_of(w)
            ]
            assert sum(m.peak_bytes for m in memory.device(w, ranges)) == x.peak_bytes[w]


def test_a_sharded_layout_is_timed_with_its_gather_and_reduce_scatter() -> None:
    """The search's step is predict_step's with dp_shard=True on the unsharded profile."""
    prof, flops = _heavy()
    x = _search(ONLY_SHARDED_FITS, top=1)[0]
    r = x.rows / prof.batch_size
    pred = predict_step(
        at_rows(prof, x.rows),
        list(x.balance),
        cluster=EIGHT,
        schedule=x.schedule,
        chunks=x.chunks,
        checkpoint=x.checkpoint,
        dp=x.dp,
        dp_shard=True,
        flops=[(f * r, b * r) for f, b in flops],
    )
    assert x.step_ms == pytest.approx(pred.step_ms)
    assert all(g > 0 for g in x.prediction.gather_ms)
    assert {a.kind for a in x.prediction.actions} >= {"all-gather", "reduce-scatter"}


def test_shards_choose_what_is_tried() -> None:
    both = _search(2**30, top=None)
    replicated = _search(2**30, top=None, shards=(False,))
    only = _search(2**30, top=None, shards=[True])
    assert not any(x.dp_shard for x in replicated)
    assert all(x.dp_shard and x.dp >= 2 for x in only)
    assert {(str(x), x.dp_shard) for x in both} == {(str(x), x.dp_shard) for x in replicated + only}
    assert [x.dp_shard for x in both if x.dp == 1] == [False] * sum(x.dp == 1 for x in both)


@pytest.mark.parametrize(
    ("shards", "error", "message"),
    [
        (True, TypeError, "shards must be a non-empty list of bools"),
        ((), TypeError, "shards must be a non-empty list of bools"),
        ((False, "yes"), TypeError, r"shards\[1\] is 'yes', not a bool"),
    ],
)
def test_bad_shards_say_how_to_fix(shards: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        _search(2**30, shards=shards)


def test_the_ranking_shows_sharding_in_text_table_and_json() -> None:
    layouts = _search(parse_bytes("1.6MiB"), top=None)
    sharded_one = next(x for x in layouts if x.dp_shard)
    whole = next(x for x in layouts if not x.dp_shard and x.dp > 1)
    assert " sharded " in str(sharded_one) and " sharded " not in str(whole)
    assert sharded_one.to_dict()["dp_shard"] is True and whole.to_dict()["dp_shard"] is False
    assert sharded_one.to_dict()["gather_ms"] > 0 == whole.to_dict()["gather_ms"]
    table = render_layouts([sharded_one, whole])
    assert "dp state" in table and "sharded" in table and "replicated" in table
    data = json.loads(layouts_json([sharded_one, whole]))
    assert [x["dp_shard"] for x in data["layouts"]] == [True, False]
    assert data["plan"]["config"]["shard"] == sharded_one.dp
    assert data["plan"]["prediction"]["dp_shard"] is True


# -- the command line --------------------------------------------------------------------------
GPT2 = ["plan", "models.transformers_zoo:gpt2", "--tokens", "4,16", "--devices", "4"]
# 4 rows: what --dp-shard does to a search does not depend on the batch (a smaller one has fewer
# micro-batch counts to try)
SEARCH = ["--capacity", "1GiB", "--cluster", "h100x8", "--batch", "4", "--top", "3"]


def test_cli_search_tries_sharding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "layouts.json"
    assert main([*GPT2, *SEARCH, "--dp-shard", "yes", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "dp state" in out and "sharded" in out and "predicted timeline" in out
    data = json.loads(js.read_text())
    assert data["layouts"] and all(x["dp_shard"] and x["dp"] > 1 for x in data["layouts"])
    assert main([*GPT2, *SEARCH, "--dp-shard", "no", "--json", str(js)]) == 0
    assert not any(x["dp_shard"] for x in json.loads(js.read_text())["layouts"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([*SEARCH, "--shard", "4"], "--shard 4 is for one plan; with --cluster"),
        (["--dp-shard", "yes"], "--dp-shard goes with --cluster and --batch"),
    ],
)
def test_cli_sharding_flags_exit_2(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*GPT2, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_sharded_only_on_one_device_says_why_nothing_runs() -> None:
    with pytest.raises(ValueError, match=r"pp=1: dp=1, no replicas to shard over"):
        _search(2**30, devices=1, shards=(True,))
