"""A real run's timeline holds every scheduled action once, in an order GPipe allows; its
drawings (SVG, PNG) and Chrome trace are valid files that show exactly those events."""

from __future__ import annotations

import itertools
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipepar
from pipepar import timeline as drawing
from pipepar.core.named_schedules import gpipe
from pipepar.recording.tracer import COMPUTE, Event, Timeline, tracing

MODES = ["always", "except_last", "never"]
SVG = "{http://www.w3.org/2000/svg}"


def _run(k: int, m: int, checkpoint: str = "except_last", *, steps: int = 1) -> Timeline:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(k)])
    pipe = pipepar.wrap(model, [1] * k, devices=["cpu"] * k, chunks=m, checkpoint=checkpoint)
    x = torch.randn(2 * m, 16)
    with tracing(pipe) as tracer:
        for _ in range(steps):
            pipe(x).pow(2).sum().backward()
    pipe.close()
    return tracer.timeline()


def _find(timeline: Timeline, stage: int, i: int, kind: str) -> Event:
    (event,) = [e for e in timeline.events if (e.stage, e.microbatch, e.kind) == (stage, i, kind)]
    return event


def _check_gpipe_run(timeline: Timeline, k: int, m: int, checkpoint: str) -> None:
    counts = Counter((e.stage, e.microbatch, e.kind) for e in timeline.events)
    for j in range(k):
        for i in range(m):
            # every scheduled action exactly once
            assert counts[(j, i, "forward")] == 1 and counts[(j, i, "backward")] == 1
            recomputed = checkpoint == "always" or (checkpoint == "except_last" and i < m - 1)
            assert counts[(j, i, "recompute")] == int(recomputed)
        # on each stage: forwards 0..M-1, then backwards M-1..0
        order = [(e.kind, e.microbatch) for e in timeline.of_stage(j) if e.kind in COMPUTE]
        assert order == [("forward", i) for i in range(m)] + [
            ("backward", i) for i in reversed(range(m))
        ]
    for i in range(m):
        for j in range(1, k):  # data dependencies, in real time
            assert (
                _find(timeline, j, i, "forward").start >= _find(timeline, j - 1, i, "forward").end
            )
            assert (
                _find(timeline, j - 1, i, "backward").start >= _find(timeline, j, i, "backward").end
            )
        for j in range(k):  # a recompute happens inside its backward
            if counts[(j, i, "recompute")]:
                r, b = _find(timeline, j, i, "recompute"), _find(timeline, j, i, "backward")
                assert b.start <= r.start <= r.end <= b.end
    # one wait (receive) per scheduled action, nothing else recorded on the CPU
    assert sum(counts[key] for key in counts if key[2] == "wait") == 2 * k * m
    assert not any(e.kind == "transfer" for e in timeline.events)


@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 3), m=st.integers(1, 5), checkpoint=st.sampled_from(MODES))
def test_every_action_once_in_an_order_gpipe_allows(k: int, m: int, checkpoint: str) -> None:
    timeline = _run(k, m, checkpoint)
    _check_gpipe_run(timeline, k, m, checkpoint)
    assert timeline.schedule().actions == gpipe(k, m).actions


def test_several_mini_batches_split_into_complete_steps() -> None:
    timeline = _run(2, 3, steps=3)
    steps = timeline.steps()
    assert len(steps) == 3
    for step in steps:
        _check_gpipe_run(step, 2, 3, "except_last")
    assert all(a.origin + a.span <= b.origin for a, b in itertools.pairwise(steps))


def test_inference_records_forwards_only() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"], chunks=3)
    with torch.no_grad(), tracing(pipe) as tracer:
        pipe(torch.randn(6, 4))
        pipe(torch.randn(6, 4))
    steps = tracer.timeline().steps()
    assert len(steps) == 2
    for step in steps:
        assert [step.actions(j) for j in range(2)] == [["F0", "F1", "F2"]] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipe_records_transfers_and_every_action() -> None:
    n = torch.cuda.device_count()
    devices = [f"cuda:{j % n}" for j in range(2)]
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    pipe = pipepar.wrap(model, [2, 1], devices=devices, chunks=4, checkpoint="never")
    with tracing(pipe) as tracer:
        pipe(torch.randn(8, 16)).sum().backward()  # the CPU input moves to stage 0's device
    timeline = tracer.timeline()
    counts = Counter((e.stage, e.kind) for e in timeline.events)
    assert counts[(0, "transfer")] >= 4
    assert timeline.schedule().actions == gpipe(2, 4).actions


# -- files -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded() -> Timeline:
    torch.manual_seed(0)
    return _run(3, 4, "except_last").steps()[-1]


def test_svg_is_valid_and_draws_each_event_once(recorded: Timeline, tmp_path: Path) -> None:
    path = drawing.save(recorded, tmp_path / "t.svg", width=1600)
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    assert int(root.get("width", 0)) == 1600
    hovers = [t.text or "" for t in root.iter(f"{SVG}title")]
    assert len(hovers) == len(recorded.events)
    fills = Counter(
        r.get("fill") for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None
    )
    for kind in ("forward", "backward", "recompute", "wait"):
        assert fills[drawing.COLORS[kind]] == sum(e.kind == kind for e in recorded.events)
    lanes = [r for r in root.iter(f"{SVG}rect") if r.get("fill") == drawing.COLORS["idle"]]
    assert len(lanes) == recorded.n_stages + 1  # one background per stage, one legend swatch
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {f"stage {j}" for j in range(3)} <= texts
    assert texts & {f"F{i}" for i in range(4)}, "micro-batches are labelled"


def test_svg_string_embeds_in_html(recorded: Timeline) -> None:
    svg = drawing.to_svg(recorded, title="a <title> & more")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    root = ET.fromstring(f"<html><body>{svg}</body></html>")
    assert root.find(f".//{SVG}svg") is not None
    assert "a &lt;title&gt; &amp; more" in svg


def test_png_opens_and_shows_every_kind(recorded: Timeline, tmp_path: Path) -> None:
    from PIL import Image

    path = drawing.save(recorded, tmp_path / "t.png", width=900)
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width == 900
        colors = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    for kind in ("forward", "backward", "idle"):
        hex_color = drawing.COLORS[kind].lstrip("#")
        assert tuple(int(hex_color[i : i + 2], 16) for i in (0, 2, 4)) in colors


def test_chrome_trace_has_one_track_per_stage(tmp_path: Path) -> None:
    timeline = _run(2, 3, steps=2)
    data = json.loads(drawing.save(timeline, tmp_path / "t.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    assert len(spans) == len(timeline.events)
    assert {e["tid"] for e in spans} == {0, 1}
    assert Counter(e["args"]["step"] for e in spans) == Counter(
        {0: len(spans) // 2, 1: len(spans) // 2}
    )
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    got = sorted(e["ts"] for e in spans if e["cat"] == "forward" and e["tid"] == 0)
    want = sorted(e.start * 1e6 for e in timeline.events if e.kind == "forward" and e.stage == 0)
    assert got == pytest.approx(want, abs=1e-2)


def test_tracer_is_accepted_where_a_timeline_is(tmp_path: Path) -> None:
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        [1, 1],
        devices=["cpu", "cpu"],
        chunks=2,
        trace=True,
    )
    pipe(torch.randn(4, 4)).sum().backward()
    assert pipe.tracer is not None
    assert drawing.to_svg(pipe.tracer) == drawing.to_svg(pipe.tracer.timeline())


def test_bad_arguments_say_how_to_fix_them(recorded: Timeline, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        drawing.save(recorded, tmp_path / "t.pdf")
    with pytest.raises(ValueError, match="width"):
        drawing.to_svg(recorded, width=50)
    with pytest.raises(TypeError, match=r"pipe\.tracer"):
        drawing.to_svg([1, 2, 3])  # type: ignore[arg-type]


def test_png_without_pillow_is_a_clear_error(
    recorded: Timeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match="pip install pillow"):
        drawing.save(recorded, tmp_path / "t.png")
    assert drawing.save(recorded, tmp_path / "t.svg").exists()  # SVG needs no Pillow


def test_html_page_shows_the_last_step_and_a_row_per_stage(tmp_path: Path) -> None:
    timeline = _run(2, 3, steps=2)
    last = timeline.steps()[-1]
    path = drawing.save(timeline, tmp_path / "t.html", title="my <run>")
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text
    assert text.count("<svg") == 1 and "<title>my &lt;run&gt;</title>" in text
    assert "last of 2 mini-batches" in text
    assert f"measured bubble {last.bubble:.1%}" in text
    rows = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td>", text)
    assert rows == [(str(j), f"{last.busy(j) * 1e3:.2f}") for j in range(2)]
    # the chart is the last step's: as many hover texts as that step has events
    assert text.count("<title>") - 1 == len(last.events)


def test_html_of_an_empty_recording_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trace=True"):
        drawing.save(Timeline([]), tmp_path / "t.html")
    assert not (tmp_path / "t.html").exists()
