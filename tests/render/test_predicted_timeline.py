"""The predicted timeline in the reports: as a Timeline (data), in the HTML report, in the
terminal report and in JSON."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch

import models
import pipepar
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layout import Layout, layouts_json
from pipepar.planner.predicted_timeline import predicted_timeline
from pipepar.render.report import render_report
from pipepar.render.report_html import render_html
from pipepar.render.step_gantt import gantt_lines
from pipepar.render.timeline import to_svg
from tests.planner._clusters import cluster

CLUSTER = cluster()


def _best(schedule: str, *, shards: tuple[bool, ...], checkpoint: str = "always") -> Layout:
    """The fastest pp=2, dp=2 layout of a 6-layer MLP with ``schedule``."""
    model, x = models.mlp(depth=3, width=32), torch.randn(8, 32)
    prof = pipepar.profile(model, x)
    layouts = pipepar.search_layouts(
        prof,
        devices=4,
        batch=32,
        cluster=CLUSTER,
        flops=count_flops(model, x, prof),
        schedules=[schedule],
        checkpoints=[checkpoint],
        shards=shards,
        top=None,
    )
    return next(x for x in layouts if (x.pp, x.dp) == (2, 2))


@pytest.fixture(scope="module")
def sharded() -> Layout:
    return _best("1f1b", shards=(True,))


@pytest.fixture(scope="module")
def replicated() -> Layout:
    return _best("1f1b", shards=(False,))


# -- the data ------------------------------------------------------------------------------
def test_the_prediction_becomes_a_timeline_of_stage_lanes(sharded: Layout) -> None:
    pred = sharded.prediction
    timeline = predicted_timeline(pred)
    assert timeline.n_stages == 2 and timeline.n_microbatches == pred.chunks
    assert timeline.span * 1e3 == pytest.approx(pred.step_ms)
    assert len(timeline.steps()) == 1
    for j in range(2):
        kinds = [e.kind for e in timeline.of_stage(j)]
        assert kinds.count("forward") == kinds.count("backward") == pred.chunks
        assert kinds.count("all-gather") == kinds.count("reduce-scatter") == 1
        assert timeline.busy(j) * 1e3 == pytest.approx(pred.busy_ms[j])
    gather = next(e for e in timeline.events if e.kind == "all-gather")
    assert (gather.start, gather.end * 1e3) == (0.0, pytest.approx(pred.gather_ms[gather.stage]))


def test_a_workers_gather_is_drawn_on_each_of_its_stages() -> None:
    """zb-v runs two stages per worker: one gather per worker, on both its lanes."""
    layout = _best("zb-v", shards=(True,), checkpoint="never")
    pred = layout.prediction
    assert sum(a.kind == "all-gather" for a in pred.actions) == 2
    timeline = predicted_timeline(pred)
    assert timeline.n_stages == 4
    gathers = sorted(e.stage for e in timeline.events if e.kind == "all-gather")
    assert gathers == [0, 1, 2, 3]


def test_a_prediction_without_actions_cannot_be_drawn(replicated: Layout) -> None:
    with pytest.raises(ValueError, match="the prediction has no actions to draw"):
        predicted_timeline(replace(replicated.prediction, actions=()))


def test_the_timeline_renderer_draws_it_with_the_collectives(sharded: Layout) -> None:
    svg = to_svg(predicted_timeline(sharded.prediction))
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "all-gather" in texts and "reduce-scatter" in texts and "all-reduce" not in texts
    hovers = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(h.startswith("stage 0 all-gather: 0.000 ms + ") for h in hovers)


# -- the reports -----------------------------------------------------------------------------
def test_html_report_shows_the_predicted_timeline_beside_the_memory(sharded: Layout) -> None:
    page = render_html(sharded.plan)
    assert "<h2>Predicted pipeline timeline</h2>" in page
    at = page.index("Predicted pipeline timeline")
    assert page.index("Memory per stage") < at < page.index("Memory per layer")
    section = page[at : page.index("Memory per layer")]
    assert "<svg" in section and "state sharded" in section and "all-gather ms" in section
    assert f"step {sharded.step_ms:.2f} ms" in section
    plain = pipepar.plan(models.mlp(depth=3, width=32), torch.randn(8, 32), devices=2)
    assert "Predicted pipeline timeline" not in render_html(plain)


def test_html_report_of_a_replicated_layout_shows_its_all_reduce(replicated: Layout) -> None:
    page = render_html(replicated.plan)
    section = page[page.index("Predicted pipeline timeline") : page.index("Memory per layer")]
    assert "all-reduce ms" in section and "all-gather" not in section


def test_terminal_report_has_a_line_per_worker(sharded: Layout) -> None:
    text = render_report(sharded.plan, width=160)
    lines = text.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("predicted timeline, one char"))
    assert "g all-gather" in lines[head] and "s reduce-scatter" in lines[head]
    workers = lines[head + 1 : head + 3]
    assert [w.split("|")[0].strip() for w in workers] == ["worker 0", "worker 1"]
    for w, line in enumerate(workers):
        bar = line.split("|")[1]
        assert len(bar) == 80 and bar[0] == "g" and set(bar) <= set("FBrgs.")
        busy = sharded.prediction.busy_ms[w]
        assert "busy " in line and "of the pipeline span" in line and busy > 0


def test_gantt_lines_of_a_hand_made_step() -> None:
    """A step of 10 ms on two workers, 10 characters: 1 ms per character."""
    from pipepar.planner.predicted_actions import PredictedAction as A
    from pipepar.planner.step_time import StepPrediction

    actions = (
        A(0, None, "all-gather", None, 0.0, 1.0),
        A(0, 0, "F", 0, 1.0, 3.0),
        A(1, 1, "F", 0, 3.0, 5.0),
        A(1, 1, "B", 0, 5.0, 8.0),
        A(1, 1, "recompute", 0, 5.0, 6.0),
        A(0, 0, "B", 0, 8.0, 9.0),
        A(0, 0, "reduce-scatter", None, 9.0, 10.0),
    )
    pred = StepPrediction(
        step_ms=10.0,
        pipeline_ms=9.0,
        bubble=0.5,
        busy_ms=(3.0, 5.0),
        stages=(),
        exposed_allreduce_ms=1.0,
        spans=(),
        schedule="1f1b",
        chunks=1,
        dp=2,
        cluster="test",
        source="flops",
        dp_shard=True,
        gather_ms=(1.0, 0.0),
        actions=actions,
    )
    lines = gantt_lines(pred, width=10)
    assert lines[1] == "worker 0 |gFF.....Bs| busy 3 ms, idle 66.7% of the pipeline span"
    assert lines[2] == "worker 1 |...FFrBB..| busy 5 ms, idle 44.4% of the pipeline span"
    with pytest.raises(ValueError, match="width must be an int >= 10"):
        gantt_lines(pred, width=5)
    assert gantt_lines(replace(pred, actions=()), width=10) == []


# -- JSON ------------------------------------------------------------------------------------
def test_json_holds_the_predicted_actions(sharded: Layout) -> None:
    data = json.loads(json.dumps(sharded.plan.to_dict()))["prediction"]
    assert data["dp_shard"] is True and data["gather_ms"] == list(sharded.prediction.gather_ms)
    assert data["actions"] == [a.to_dict() for a in sharded.prediction.actions]
    first = data["actions"][0]
    assert first["kind"] == "all-gather" and first["stage"] is None and first["start_ms"] == 0.0
    assert {a["kind"] for a in data["actions"]} == {
        "F",
        "B",
        "recompute",
        "all-gather",
        "reduce-scatter",
    }
    layouts = json.loads(layouts_json([sharded]))
    assert layouts["plan"]["prediction"]["actions"] == data["actions"]
    assert layouts["layouts"][0]["dp_shard"] is True
