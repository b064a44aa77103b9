"""Drawing a pipeline timeline: a Gantt chart (SVG, PNG) and a Chrome trace (Perfetto).

One lane per stage, time running left to right. Forward (``F3``), backward (``B3``) and the
recompute inside a checkpointed backward (``R3``) are labelled bars; waits on the neighbour and
transfers are thin bars; the lane's background shows through where the stage idles, so the
bubble is the pink area. The same layout feeds the SVG (written by hand, embeddable in HTML)
and the PNG (drawn with Pillow, imported only when a PNG is asked for).

    >>> from pipepar import timeline
    >>> timeline.save(pipe.tracer, "pipeline.png")    # .svg, .html, or .json for ui.perfetto.dev
    >>> html = f"<h2>Pipeline</h2>{timeline.to_svg(pipe.tracer)}"

Writing a file by its suffix (:func:`pipepar.timeline.save`) is in
:mod:`pipepar.render.timeline_files`, which reads this module and the HTML page's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from pipepar.recording.tracer import Timeline, Tracer

__all__ = [
    "COLLECTIVES",
    "COLORS",
    "as_timeline",
    "save_chrome_trace",
    "save_png",
    "save_svg",
    "to_chrome_trace",
    "to_svg",
]

COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "weight": "#54A24B",
    "recompute": "#B279A2",
    "wait": "#BDBDBD",
    "transfer": "#E4B200",
    "idle": "#FBE3E3",
    "all-gather": "#72B7B2",
    "all-reduce": "#9D755D",
    "reduce-scatter": "#E45756",
}
"""Fill colour of each event kind, and of idle time (the bubble); the data-parallel
collectives appear in predicted timelines (:mod:`pipepar.planner.predicted_timeline`)."""

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter")
"""Event kinds of a predicted step's data-parallel collectives, drawn when present."""

_LANE, _GAP, _LEFT, _RIGHT, _TOP, _BOTTOM = 34, 8, 70, 20, 46, 62
_FONT = 11


@dataclass(frozen=True)
class _Box:
    """A filled rectangle in pixels, with an optional centred label and a hover text."""

    x0: float
    y0: float
    x1: float
    y1: float
    fill: str
    label: str = ""
    hover: str = ""


@dataclass(frozen=True)
class _Chart:
    """Everything to draw, in pixels: backgrounds, bars, axis ticks, texts, legend."""

    width: int
    height: int
    title: str
    boxes: list[_Box]
    ticks: list[tuple[float, str]]
    lanes: list[tuple[float, str]]  # (y of the lane's centre, its name)
    separators: list[float]  # x of each mini-batch boundary after the first
    legend: list[tuple[str, str]]  # (fill, name)


def as_timeline(source: Timeline | Tracer) -> Timeline:
    """``source`` itself, or the tracer's recording as a :class:`Timeline`; TypeError else."""
    if isinstance(source, Tracer):
        return source.timeline()
    if isinstance(source, Timeline):
        return source
    raise TypeError(
        f"expected a Timeline or a Tracer, got {type(source).__name__}; pass pipe.tracer "
        "(build the pipe with trace=True) or tracer.timeline()"
    )


def _check_width(width: int) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or width < 200:
        raise ValueError(f"width must be an int of at least 200 pixels, got {width!r}; e.g. 1000")
    return width


def _layout(timeline: Timeline, width: int, title: str | None) -> _Chart:
    k = max(timeline.n_stages, 1)
    span = max(timeline.span, 1e-9)
    plot = width - _LEFT - _RIGHT
    height = _TOP + k * (_LANE + _GAP) + _BOTTOM

    def x(t: float) -> float:
        return _LEFT + (t - timeline.start) / span * plot

    def lane(j: int) -> float:
        return _TOP + j * (_LANE + _GAP)

    boxes = [_Box(_LEFT, lane(j), _LEFT + plot, lane(j) + _LANE, COLORS["idle"]) for j in range(k)]
    for e in sorted(timeline.events, key=lambda e: _DRAW_ORDER[e.kind]):
        top = lane(e.stage)
        y0, y1 = _BANDS[e.kind]
        when = f"{e.start * 1e3:.3f} ms + {e.duration * 1e3:.3f} ms"
        what = e.kind if e.kind in COLLECTIVES else f"{e.label} {e.kind}"
        hover = f"stage {e.stage} {what}: {when}"
        x0, x1 = x(e.start), max(x(e.end), x(e.start) + 0.5)
        text = e.label if e.kind in ("forward", "backward", "weight", "recompute") else ""
        fits = (x1 - x0) >= _text_width(text) + 4
        boxes.append(
            _Box(
                x0,
                top + y0 * _LANE,
                x1,
                top + y1 * _LANE,
                COLORS[e.kind],
                text if fits else "",
                hover,
            )
        )
    return _Chart(
        width=width,
        height=height,
        title=title if title is not None else _title(timeline),
        boxes=boxes,
        ticks=[(x(timeline.start + t), f"{t * 1e3:g}") for t in _ticks(span)],
        lanes=[(lane(j) + _LANE / 2, f"stage {j}") for j in range(k)],
        separators=[x(s.origin - timeline.origin) for s in timeline.steps()[1:]],
        legend=_legend({e.kind for e in timeline.events}),
    )


# Vertical extent of each kind within its lane (fractions); recompute sits inside the backward.
_BANDS = {
    "forward": (0.0, 1.0),
    "backward": (0.0, 1.0),
    "weight": (0.0, 1.0),
    "recompute": (0.55, 1.0),
    "wait": (0.42, 0.58),
    "transfer": (0.3, 0.7),
    "all-gather": (0.15, 0.85),
    "all-reduce": (0.15, 0.85),
    "reduce-scatter": (0.15, 0.85),
}
_DRAW_ORDER = {
    "wait": 0,
    "transfer": 1,
    "all-gather": 1,
    "all-reduce": 1,
    "reduce-scatter": 1,
    "forward": 2,
    "backward": 2,
    "weight": 2,
    "recompute": 3,
}


def _title(timeline: Timeline) -> str:
    return (
        f"{timeline.n_stages} stages x {timeline.n_microbatches} micro-batches: "
        f"span {timeline.span * 1e3:.1f} ms, bubble {timeline.bubble:.0%} "
        f"(GPipe bound {timeline.ideal_bubble:.0%})"
    )


def _text_width(text: str) -> float:
    return 0.62 * _FONT * len(text)


def _ticks(span: float, target: int = 8) -> list[float]:
    """Round tick positions (1, 2 or 5 x 10^n milliseconds) from 0 to ``span`` seconds."""
    raw = span / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(f * base for f in (1, 2, 5, 10) if f * base >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _legend(kinds: set[str]) -> list[tuple[str, str]]:
    """The usual kinds, and the collectives among ``kinds`` (those drawn)."""
    names = ["forward", "backward", "weight", "recompute", "wait", "transfer"]
    names += [c for c in COLLECTIVES if c in kinds]
    return [(COLORS[n], n) for n in names] + [(COLORS["idle"], "idle (bubble)")]


# -- SVG ---------------------------------------------------------------------------------------
def to_svg(source: Timeline | Tracer, *, width: int = 1000, title: str | None = None) -> str:
    """The timeline as a Gantt chart, one ``<svg>`` element ready to embed in HTML.

    Args:
        source: a :class:`~pipepar.trace.Timeline` or the pipe's :class:`~pipepar.trace.Tracer`.
        width: width of the picture in pixels.
        title: the heading; default: stages, micro-batches, span and bubble.

    Example:
        >>> svg = to_svg(pipe.tracer.timeline().steps()[-1])
        >>> svg.startswith("<svg")
        True
    """
    chart = _layout(as_timeline(source), _check_width(width), title)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{chart.width}" height="{chart.height}" '
        f'viewBox="0 0 {chart.width} {chart.height}" font-family="sans-serif" '
        f'font-size="{_FONT}">',
        f'<rect width="{chart.width}" height="{chart.height}" fill="white"/>',
        f'<text x="{_LEFT}" y="20" font-size="{_FONT + 2}">{escape(chart.title)}</text>',
    ]
    parts += [_svg_box(b) for b in chart.boxes]
    parts += [
        f'<text x="{_LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{escape(name)}</text>'
        for y, name in chart.lanes
    ]
    parts += _svg_axis(chart)
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_box(b: _Box) -> str:
    rect = (
        f'<rect x="{b.x0:.2f}" y="{b.y0:.2f}" width="{b.x1 - b.x0:.2f}" '
        f'height="{b.y1 - b.y0:.2f}" fill="{b.fill}"'
    )
    if b.hover:
        rect += f' stroke="white" stroke-width="0.5"><title>{escape(b.hover)}</title></rect>'
    else:
        rect += "/>"
    if not b.label:
        return rect
    cx, cy = (b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2 + _FONT * 0.35
    label = f'<text x="{cx:.2f}" y="{cy:.2f}" text-anchor="middle" fill="white">'
    return rect + label + f"{escape(b.label)}</text>"


def _svg_axis(chart: _Chart) -> list[str]:
    base = chart.height - _BOTTOM + 6
    right = chart.width - _RIGHT
    out = [f'<line x1="{_LEFT}" y1="{base}" x2="{right}" y2="{base}" stroke="#444"/>']
    for x, label in chart.ticks:
        out.append(f'<line x1="{x:.2f}" y1="{base}" x2="{x:.2f}" y2="{base + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{base + 16}" text-anchor="middle">{escape(label)}</text>')
    out.append(f'<text x="{_LEFT - 8}" y="{base + 16}" text-anchor="end">ms</text>')
    for x in chart.separators:
        out.append(
            f'<line x1="{x:.2f}" y1="{_TOP - 4}" x2="{x:.2f}" y2="{base}" stroke="#444" '
            'stroke-dasharray="4 3"/>'
        )
    lx = _LEFT
    for fill, name in chart.legend:
        out.append(f'<rect x="{lx}" y="{base + 26}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{lx + 16}" y="{base + 36}">{escape(name)}</text>')
        lx += 24 + int(_text_width(name))
    return out


def save_svg(source: Timeline | Tracer, path: str | Path, **options: Any) -> Path:
    """Write :func:`to_svg` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(to_svg(source, **options), encoding="utf-8")
    return path


# -- PNG ---------------------------------------------------------------------------------------
def save_png(
    source: Timeline | Tracer, path: str | Path, *, width: int = 1000, title: str | None = None
) -> Path:
    """Draw the Gantt chart with Pillow and write it as a PNG; returns the path.

    Raises:
        ImportError: if Pillow is not installed (it comes with torchvision).

    Example:
        >>> save_png(pipe.tracer, "pipeline.png")
        PosixPath('pipeline.png')
    """
    try:
        from PIL import Image, ImageDraw
    except ImportError as error:
        raise ImportError(
            "saving the timeline as PNG needs Pillow, which is not installed; "
            "`pip install pillow` (torchvision brings it), or save it as .svg or .json instead"
        ) from error
    chart = _layout(as_timeline(source), _check_width(width), title)
    image = Image.new("RGB", (chart.width, chart.height), "white")
    draw = ImageDraw.Draw(image)
    font = _pil_font()
    draw.text((_LEFT, 8), chart.title, fill="black", font=font)
    for b in chart.boxes:
        x1 = max(b.x1 - 1, b.x0)
        draw.rectangle([b.x0, b.y0, x1, b.y1 - 1], fill=b.fill)
        if b.hover and x1 - b.x0 >= 3:  # a white edge keeps neighbouring actions apart
            draw.line([(x1, b.y0), (x1, b.y1 - 1)], fill="white")
        if b.label:
            cx, cy = (b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2
            draw.text((cx, cy), b.label, fill="white", font=font, anchor="mm")
    for y, name in chart.lanes:
        draw.text((_LEFT - 8, y), name, fill="black", font=font, anchor="rm")
    _png_axis(draw, chart, font)
    path = Path(path)
    image.save(path, format="PNG")
    return path


def _pil_font() -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=_FONT + 1)
    except TypeError:  # Pillow < 10.1 has one fixed-size bitmap font
        return ImageFont.load_default()


def _png_axis(draw: Any, chart: _Chart, font: Any) -> None:
    base = chart.height - _BOTTOM + 6
    draw.line([(_LEFT, base), (chart.width - _RIGHT, base)], fill="#444")
    for x, label in chart.ticks:
        draw.line([(x, base), (x, base + 4)], fill="#444")
        draw.text((x, base + 6), label, fill="black", font=font, anchor="ma")
    draw.text((_LEFT - 8, base + 6), "ms", fill="black", font=font, anchor="ra")
    for x in chart.separators:
        for y in range(_TOP - 4, base, 7):
            draw.line([(x, y), (x, min(y + 4, base))], fill="#444")
    lx = _LEFT
    for fill, name in chart.legend:
        draw.rectangle([lx, base + 26, lx + 11, base + 37], fill=fill)
        draw.text((lx + 16, base + 26), name, fill="black", font=font)
        lx += 24 + int(_text_width(name))


# -- Chrome trace ------------------------------------------------------------------------------
def to_chrome_trace(source: Timeline | Tracer) -> dict[str, Any]:
    """The events in Chrome's trace event format: one track (thread) per stage.

    Open the saved JSON in https://ui.perfetto.dev or chrome://tracing. Times are microseconds
    since the first event; each event's ``args`` hold its stage, micro-batch, kind and the
    mini-batch (step) it belongs to.

    Example:
        >>> trace = to_chrome_trace(pipe.tracer)
        >>> sorted(trace)
        ['displayTimeUnit', 'otherData', 'traceEvents']
    """
    timeline = as_timeline(source)
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": "pipepar"}}
    ]
    for j in range(timeline.n_stages):
        events.append(
            {"ph": "M", "pid": 0, "tid": j, "name": "thread_name", "args": {"name": f"stage {j}"}}
        )
        events.append(
            {"ph": "M", "pid": 0, "tid": j, "name": "thread_sort_index", "args": {"sort_index": j}}
        )
    for step, part in enumerate(timeline.steps()):
        shift = part.origin - timeline.origin
        events += [
            {
                "name": e.label,
                "cat": e.kind,
                "ph": "X",
                "ts": round((e.start + shift) * 1e6, 3),
                "dur": round(e.duration * 1e6, 3),
                "pid": 0,
                "tid": e.stage,
                "args": {
                    "stage": e.stage,
                    "microbatch": e.microbatch,
                    "kind": e.kind,
                    "step": step,
                },
            }
            for e in part.events
        ]
    other = {
        "stages": timeline.n_stages,
        "microbatches": timeline.n_microbatches,
        "bubble": timeline.bubble,
        "ideal_bubble": timeline.ideal_bubble,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def save_chrome_trace(source: Timeline | Tracer, path: str | Path) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(source)), encoding="utf-8")
    return path
