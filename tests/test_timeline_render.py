"""The recorded timeline holds every scheduled action once, in an order GPipe allows, and draws."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

import pipepar
from pipepar import schedule, timeline
from pipepar.trace import Timeline, tracing

K, M = 3, 4


def _traced_pipe(checkpoint: str = "except_last") -> pipepar.Pipe:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    return pipepar.wrap(
        model, [2, 2, 2], devices=["cpu"] * K, chunks=M, checkpoint=checkpoint, trace=True
    )


def _one_step(pipe: pipepar.Pipe) -> Timeline:
    assert pipe.tracer is not None
    pipe.tracer.clear()
    pipe(torch.randn(8, 8)).sum().backward()
    return pipe.tracer.timeline()


def _action(t: Timeline, stage: int, kind: str, i: int):  # type: ignore[no-untyped-def]
    [event] = [e for e in t.events if (e.stage, e.kind, e.microbatch) == (stage, kind, i)]
    return event


def test_every_action_once_in_gpipe_order() -> None:
    t = _one_step(_traced_pipe())
    assert t.schedule().actions == schedule.gpipe(K, M).actions
    for j in range(K):
        for i in range(M):
            f, b = _action(t, j, "forward", i), _action(t, j, "backward", i)
            assert f.end <= b.start
            if j > 0:
                assert _action(t, j - 1, "forward", i).end <= f.start
            if j < K - 1:
                assert _action(t, j + 1, "backward", i).end <= b.start


def test_recompute_nested_in_backward_for_checkpointed_microbatches() -> None:
    t = _one_step(_traced_pipe("except_last"))
    recomputed = sorted({(e.stage, e.microbatch) for e in t.events if e.kind == "recompute"})
    assert recomputed == [(j, i) for j in range(K) for i in range(M - 1)]
    for j, i in recomputed:
        r, b = _action(t, j, "recompute", i), _action(t, j, "backward", i)
        assert b.start <= r.start and r.end <= b.end


def test_figures_and_steps() -> None:
    pipe = _traced_pipe("never")
    for _ in range(2):
        pipe(torch.randn(8, 8)).sum().backward()
    assert pipe.tracer is not None
    steps = pipe.tracer.timeline().steps()
    assert len(steps) == 2
    for t in steps:
        assert (t.n_stages, t.n_microbatches) == (K, M)
        assert 0 <= t.bubble < 1
        assert t.ideal_bubble == pytest.approx((K - 1) / (M + K - 1))
        assert "bubble" in t.summary()


def test_tracing_block_and_off_by_default() -> None:
    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [1, 1], devices=["cpu"] * 2, chunks=2
    )
    assert pipe.tracer is None
    with tracing(pipe) as tracer:
        pipe(torch.randn(4, 4)).sum().backward()
    assert pipe.tracer is None
    kinds = [e.kind for e in tracer.events]
    assert kinds.count("forward") == kinds.count("backward") == 4
    with (
        pytest.raises(TypeError, match=r"needs a pipe built by pipepar\.wrap"),
        tracing(nn.Linear(2, 2)),
    ):
        pass


def test_files_are_valid(tmp_path: Path) -> None:
    t = _one_step(_traced_pipe())
    svg = timeline.save(t, tmp_path / "t.svg")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    labels = {el.text for el in root.iter() if el.tag.endswith("text")}
    assert {"F0", "B3"} <= labels
    png = timeline.save(t, tmp_path / "t.png")
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 100
    trace = json.loads(timeline.save(t, tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(t.events)
    assert {e["tid"] for e in spans} == set(range(K))
    with pytest.raises(ValueError, match=r"name it \.svg or \.png"):
        timeline.save(t, tmp_path / "t.gif")
