"""Reports: the terminal table, JSON with units, and the self-contained HTML with charts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.units import format_bytes
from pipepar.planner.plan import Plan, plan
from pipepar.planner.profile import profile
from pipepar.render.report import shape_text

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def fitted() -> Plan:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    prof = profile(model, torch.randn(16, 3, 16, 16), device="cpu")
    return plan(prof, devices=["cpu", "cpu", "cpu"], capacity=["2MiB", "3MiB", "2MiB"], chunks=4)


def test_table_has_a_row_per_layer_and_per_stage_with_totals(fitted: Plan) -> None:
    text = pipepar.report.table(fitted, width=200)
    for layer in fitted.layers:
        row = next(
            line
            for line in text.splitlines()
            if re.match(rf"\s+{layer.index}\s+{layer.name}\s", line)
        )
        assert layer.type_name in row and shape_text(layer.output_shape) in row
        assert format_bytes(layer.params_bytes) in row
    for stage in fitted.stages:
        row = next(
            line for line in text.splitlines() if re.match(rf"\s+{stage.index}\s+cpu\s", line)
        )
        assert format_bytes(stage.peak_bytes) in row and format_bytes(stage.capacity_bytes) in row
        assert format_bytes(stage.headroom_bytes) in row and f"x{stage.in_flight}" in row
    assert "total" in text
    assert f"predicted bubble of gpipe (from its schedule, F = B = W) {2 / 6:.1%}" in text
    assert "\x1b[" not in text  # no colors unless asked


def test_json_has_everything_with_units(fitted: Plan) -> None:
    data = json.loads(fitted.to_json())
    assert data["balance"] == fitted.balance and data["bubble"] == pytest.approx(fitted.bubble)
    assert data["units"]["*_bytes"] == "B" and data["units"]["*_ms"] == "ms"
    assert data["config"]["chunks"] == 4 and data["config"]["devices"] == ["cpu"] * 3
    for stage, s in zip(data["stages"], fitted.stages):
        parts = (
            "params_bytes",
            "grads_bytes",
            "optimizer_bytes",
            "activation_bytes",
            "transient_bytes",
        )
        assert sum(stage[p] for p in parts) == stage["peak_bytes"] == s.peak_bytes
        assert stage["capacity_bytes"] - stage["peak_bytes"] == stage["headroom_bytes"]
    assert [x["stage"] for x in data["layers"]] == [
        fitted.stage_of(i) for i in range(len(fitted.layers))
    ]
    assert data["layers"][0]["output_shape"] == [16, 8, 16, 16]
    assert data["totals"]["params_bytes"] == fitted.profile.total("params_bytes")


def test_html_is_self_contained_with_one_capacity_line_per_stage(
    tmp_path: Path, fitted: Plan
) -> None:
    path = pipepar.report.save_html(fitted, tmp_path / "sub" / "report.html")
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<svg") == 3
    assert "<script" not in text and not re.search(r"(src|href)=\"(https?:)?//", text)
    assert text.count('stroke-dasharray="6 3"') == len(fitted.stages)
    for stage in fitted.stages:
        for field, label in [("params_bytes", "parameters"), ("activation_bytes", "activations")]:
            value = getattr(stage, field)
            drawn = f"stage {stage.index} {label}" in text
            assert drawn == (value > 0)  # one bar segment per non-empty part, with its size
            assert (
                not drawn
                or f"{label} in flight: {format_bytes(value)}" in text
                or (f"{label}: {format_bytes(value)}" in text)
            )
        assert f"{stage.device} capacity {format_bytes(stage.capacity_bytes)}" in text


def test_html_marks_a_plan_that_does_not_fit(fitted: Plan, tmp_path: Path) -> None:
    from dataclasses import replace

    over = replace(
        fitted, stages=[replace(s, capacity_bytes=s.peak_bytes // 2) for s in fitted.stages]
    )
    text = pipepar.report.save_html(over, tmp_path / "over.html").read_text()
    assert "does not fit" in text and 'class="over"' in text
    assert "DOES NOT FIT" in pipepar.report.table(over)


def test_html_embeds_a_measured_run_beside_the_plan(fitted: Plan, tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    pipe = pipepar.wrap(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4, trace=True)
    pipe(torch.randn(8, 8)).sum().backward()
    assert pipe.tracer is not None
    path = pipepar.report.save_html(fitted, tmp_path / "r.html", timeline=pipe.tracer)
    text = path.read_text()
    assert text.count("<svg") == 4  # the plan's three charts and the timeline
    # after the stage chart and its table, before the per-layer charts
    heads = ("Memory per stage", "</table>", "Measured pipeline", "Memory per layer")
    order = [text.index(h) for h in heads]
    assert order == sorted(order)
    step = pipe.tracer.timeline().steps()[-1]
    assert f"measured bubble {step.bubble:.1%}" in text
    assert f"predicted bubble of the schedule {fitted.bubble:.1%}" in text


def test_a_plan_names_where_its_renderers_went(fitted: Plan) -> None:
    # A plan is data: it does not import its renderers, so the old methods point to them.
    with pytest.raises(AttributeError, match=r"pipepar\.report\.table\(plan"):
        fitted.report()  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=r"pipepar\.report\.save_html\(plan, path"):
        fitted.save_html("x.html")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="has no attribute 'balanse'"):
        fitted.balanse  # type: ignore[attr-defined]  # noqa: B018


def test_html_with_a_bad_timeline_leaves_no_file(fitted: Plan, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"pipe\.tracer"):
        bad = [1, 2]
        pipepar.report.save_html(fitted, tmp_path / "r.html", timeline=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "r.html").exists()


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs /usr/bin/chromium (.ci/run installs it)"
)
def test_html_renders_in_headless_chromium(tmp_path: Path, fitted: Plan) -> None:
    page = pipepar.report.save_html(fitted, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert dom.count("<svg") == 3 and "pipepar plan" in dom
    subprocess.run(
        [CHROMIUM, *flags, "--window-size=1200,1400", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.exists() and shot.stat().st_size > 20_000  # charts drawn, not a blank page


def test_shape_text() -> None:
    assert shape_text((64, 3, 224, 224)) == "64x3x224x224"
    assert shape_text(((8, 16), (8,))) == "8x16, 8"
    assert shape_text(()) == "-"
