"""A plan as one self-contained HTML file: inline SVG charts and tables, no scripts, no fetches.

Charts: per stage, stacked bars of parameters / gradients / optimizer state / activations /
temporaries against a dashed line at the device's capacity; per layer, memory bars and times,
with the stages as coloured bands. A plan with a predicted step (a layout's) shows the
predicted pipeline timeline beside the memory per stage, drawn as a measured run is
(:func:`pipepar.render.timeline_html.section` of
:func:`~pipepar.planner.predicted_timeline.predicted_timeline`).

    >>> pipepar.report.save_html(plan, "report.html")   # open it in any browser, offline
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

from pipepar.core.units import format_bytes
from pipepar.render.report import prediction_text, shape_text

if TYPE_CHECKING:
    from pipepar.planner.plan import Plan
    from pipepar.recording.tracer import Timeline, Tracer

__all__ = ["render_html", "write_html"]

PARTS = [
    ("params_bytes", "parameters", "#4e79a7"),
    ("grads_bytes", "gradients", "#f28e2b"),
    ("optimizer_bytes", "optimizer state", "#e15759"),
    ("activation_bytes", "activations in flight", "#76b7b2"),
    ("transient_bytes", "temporaries", "#59a14f"),
]
CAPACITY_COLOR = "#d62728"
BAND_COLORS = ["#f3f6fa", "#fbf7ee"]
_UNITS = [
    ("B", 1),
    ("KiB", 1024),
    ("MiB", 1024**2),
    ("GiB", 1024**3),
    ("TiB", 1024**4),
    ("PiB", 1024**5),
]

_CSS = (
    "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px;"
    "color:#222;max-width:1200px}"
    "h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;"
    "border-bottom:1px solid #ddd}"
    ".meta{color:#555;font-size:13px} .ok{color:#2a7d2a;font-weight:600}"
    " .bad{color:#c0392b;font-weight:600}"
    "table{border-collapse:collapse;font-size:12px;margin-top:6px}"
    " td,th{padding:3px 8px;border-bottom:1px solid #eee}"
    "th{background:#f5f5f5;text-align:left}"
    " td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "tr.over td{background:#fdecea} svg text{font-family:inherit}"
    ".legend span{display:inline-block;margin-right:14px;font-size:12px}"
    ".legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}"
)


def write_html(
    plan: Plan, path: str | Path, *, timeline: Timeline | Tracer | None = None
) -> Path:
    """Write a self-contained HTML report (inline SVG charts, no scripts) to ``path``.

    Users call it as :func:`pipepar.report.save_html`.

    Args:
        plan: the plan to show.
        path: the ``.html`` file to write (parents created).
        timeline: a run of the pipe recorded with ``trace=True`` (``pipe.tracer`` or a
            :class:`~pipepar.recording.tracer.Timeline`); its last mini-batch is drawn after the
            stage table, with the measured bubble beside the predicted one.

    Returns:
        The path written.

    Example:
        >>> plan = pipepar.plan(prof, devices=2, chunks=4, schedule="1f1b")
        >>> pipepar.report.save_html(plan, "plan.html", timeline=pipe.tracer)
        PosixPath('plan.html')
    """
    page = render_html(plan, timeline=timeline)  # before touching the file: errors leave it
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def render_html(plan: Plan, *, timeline: Timeline | Tracer | None = None) -> str:
    """The whole report as an HTML string; with ``timeline``, a measured run beside the plan.

    Users call it as :func:`pipepar.report.html`.

    Args:
        plan: the plan to show.
        timeline: a run of the pipe recorded with ``trace=True`` (``pipe.tracer`` or a
            :class:`~pipepar.Timeline`), drawn after the stage table.

    Returns:
        A self-contained HTML page (inline SVG charts, no scripts).

    Example:
        >>> render_html(plan).startswith("<!DOCTYPE html>")
        True
    """
    fits = all(s.fits for s in plan.stages)
    verdict = '<span class="ok">fits</span>' if fits else '<span class="bad">does not fit</span>'
    k = len(plan.stages)
    body = [
        "<h1>pipepar plan</h1>",
        f'<div class="meta">balance <b>{plan.balance}</b> &middot; {verdict} &middot; peak '
        f"{format_bytes(plan.peak_bytes)} &middot; {k} stages, {plan.schedule}, {plan.chunks} "
        f"micro-batches of {plan.micro_batch_rows} rows, checkpoint={plan.checkpoint}, "
        f"optimizer={_e(plan.profile.optimizer)} &middot; predicted bubble of the schedule "
        f"{plan.bubble:.1%} &middot; profiled on {_e(plan.profile.device)}, balanced by "
        f"{plan.objective}</div>",
        *_predicted(plan),
        "<h2>Memory per stage</h2>",
        _legend(PARTS + [("", "capacity", CAPACITY_COLOR)]),
        _stage_chart(plan),
        _stage_table(plan),
        *_predicted_timeline(plan),
        *_measured(timeline),
        "<h2>Memory per layer</h2>",
        _legend(
            [
                PARTS[0],
                ("", "gradients + optimizer", "#f0a35e"),
                ("", "activations (whole batch)", PARTS[3][2]),
            ]
        ),
        _layer_memory_chart(plan),
        "<h2>Time per layer</h2>",
        _layer_time_chart(plan),
        "<h2>Layers</h2>",
        _layer_table(plan),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>pipepar plan {plan.balance}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _predicted(plan: Plan) -> list[str]:
    text = prediction_text(plan)
    return [] if text is None else [f'<div class="meta">{_e(text)}</div>']


def _predicted_timeline(plan: Plan) -> list[str]:
    """The predicted step's timeline, when the plan has a prediction with its actions."""
    pred = plan.prediction
    if pred is None or not pred.actions:
        return []
    from pipepar.planner.predicted_timeline import predicted_timeline
    from pipepar.render.timeline_html import section

    how = f"dp={pred.dp}" + (", state sharded" if pred.dp_shard else "")
    summary = (
        f"predicted on {pred.cluster} ({how}): step {pred.step_ms:.2f} ms, pipeline span "
        f"{pred.pipeline_ms:.2f} ms, bubble {pred.bubble:.1%} over the span, {pred.schedule}, "
        f"{pred.chunks} micro-batches; gradient collectives exposed after the span "
        f"{pred.exposed_allreduce_ms:.2f} ms"
    )
    if pred.dp_shard:
        summary += f"; weights' all-gather before the first action {max(pred.gather_ms):.2f} ms"
    title = f"predicted step: {len(plan.stages)} stages x {pred.chunks} micro-batches"
    timeline = predicted_timeline(pred)
    return [section(timeline, heading="Predicted pipeline timeline", summary=summary, title=title)]


def _measured(timeline: Timeline | Tracer | None) -> list[str]:
    """The recorded run's section, after the predicted stage table; nothing without one."""
    if timeline is None:
        return []
    from pipepar.render.timeline_html import section

    return [section(timeline, heading="Measured pipeline timeline (a real run)")]


def _e(text: object) -> str:
    return html.escape(str(text))


def _legend(items: list[tuple[str, str, str]]) -> str:
    spans = "".join(
        f'<span><i style="background:{c}"></i>{_e(label)}</span>' for _, label, c in items
    )
    return f'<div class="legend">{spans}</div>'


def _axis(top: float) -> tuple[str, int, list[float]]:
    """A byte unit and round tick values from 0 to at least ``top``."""
    top = max(top, 1.0)
    unit, scale = next(((u, s) for u, s in reversed(_UNITS) if top >= s), _UNITS[0])
    raw = top / scale / 5
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)
    ticks = [i * step * scale for i in range(math.ceil(top / scale / step) + 1)]
    return unit, scale, ticks


def _tick_label(value: float, unit: str, scale: int) -> str:
    number = value / scale
    return f"{number:g} {unit}" if number else "0"


def _svg(width: int, height: int, parts: list[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(label)}" '
        'style="max-width:100%;height:auto">' + "".join(parts) + "</svg>"
    )


def _y_grid(
    ticks: list[float], unit: str, scale: int, y: object, left: int, right: int
) -> list[str]:
    out = []
    for t in ticks:
        py = y(t)  # type: ignore[operator]
        out.append(f'<line x1="{left}" x2="{right}" y1="{py:.1f}" y2="{py:.1f}" stroke="#e5e5e5"/>')
        out.append(
            f'<text x="{left - 6}" y="{py + 4:.1f}" font-size="11" text-anchor="end" '
            f'fill="#555">{_tick_label(t, unit, scale)}</text>'
        )
    return out


def _stage_chart(plan: Plan) -> str:
    k = len(plan.stages)
    caps = [s.capacity_bytes for s in plan.stages if s.capacity_bytes is not None]
    top = max([s.peak_bytes for s in plan.stages] + caps) * 1.08
    unit, scale, ticks = _axis(top)
    top = ticks[-1]
    left, right, head, foot = 80, 30, 16, 48
    bar_w = max(8, min(90, 1000 // (2 * k)))
    width = left + right + k * bar_w * 2
    height = 320
    inner = height - head - foot

    def y(v: float) -> float:
        return head + inner * (1 - v / top)

    parts = _y_grid(ticks, unit, scale, y, left, width - right)
    for s in plan.stages:
        x = left + s.index * bar_w * 2 + bar_w / 2
        base = 0.0
        for field, label, color in PARTS:
            value = getattr(s, field)
            if value <= 0:
                continue
            y0, y1 = y(base), y(base + value)
            parts.append(
                f'<rect x="{x:.1f}" y="{y1:.1f}" width="{bar_w}" height="{max(y0 - y1, 0.5):.1f}" '
                f'fill="{color}"><title>stage {s.index} {label}: {format_bytes(value)}'
                "</title></rect>"
            )
            base += value
        if s.capacity_bytes is not None:
            cy = y(s.capacity_bytes)
            parts.append(
                f'<line x1="{x - 8:.1f}" x2="{x + bar_w + 8:.1f}" y1="{cy:.1f}" y2="{cy:.1f}" '
                f'stroke="{CAPACITY_COLOR}" stroke-width="2" stroke-dasharray="6 3">'
                f"<title>{_e(s.device)} capacity {format_bytes(s.capacity_bytes)}</title></line>"
            )
        color = "#222" if s.fits else CAPACITY_COLOR
        parts.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{y(base) - 5:.1f}" font-size="11" '
            'text-anchor="middle" '
            f'fill="{color}">{format_bytes(s.peak_bytes)}</text>'
        )
        parts.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{height - foot + 16}" font-size="12" '
            f'text-anchor="middle">{"stage " if bar_w * 2 >= 70 else ""}{s.index}</text>'
            f'<text x="{x + bar_w / 2:.1f}" y="{height - foot + 31}" font-size="10" '
            f'text-anchor="middle" fill="#666">{_e(s.device)} &#183; x{s.in_flight}</text>'
            if bar_w * 2 >= 90
            else ""
        )
    return _svg(width, height, parts, "stacked memory per stage against capacity")


def _bands(plan: Plan, x_of: object, step: float, head: int, inner: float) -> list[str]:
    out = []
    for s in plan.stages:
        x0 = x_of(s.layers.start)  # type: ignore[operator]
        w = step * len(s.layers)
        out.append(
            f'<rect x="{x0:.1f}" y="{head}" width="{w:.1f}" height="{inner:.1f}" '
            f'fill="{BAND_COLORS[s.index % 2]}"/>'
            f'<text x="{x0 + w / 2:.1f}" y="{head + 12}" font-size="10" text-anchor="middle" '
            f'fill="#888">stage {s.index}</text>'
        )
    return out


def _layer_chart(
    plan: Plan, series: list[tuple[list[float], str, str]], unit_fn: object, label: str
) -> str:
    n = len(plan.layers)
    step = max(2.0, min(40.0, 1000 / n))
    left, right, head, foot = 80, 20, 18, 110
    width, height = int(left + right + step * n), 340
    inner = height - head - foot
    top = max(max(sum(v) for v in zip(*(s[0] for s in series))), 1e-9) * 1.1
    unit, scale, ticks = unit_fn(top)  # type: ignore[operator]
    top = ticks[-1] or 1

    def x_of(i: int) -> float:
        return left + i * step

    def y(v: float) -> float:
        return head + inner * (1 - v / top)

    parts = _bands(plan, x_of, step, head, inner)
    parts += _y_grid(ticks, unit, scale, y, left, width - right)
    for i, layer in enumerate(plan.layers):
        base = 0.0
        for values, name, color in series:
            v = values[i]
            if v > 0:
                parts.append(
                    f'<rect x="{x_of(i) + step * 0.15:.1f}" y="{y(base + v):.1f}" '
                    f'width="{step * 0.7:.1f}" height="{max(y(base) - y(base + v), 0.5):.1f}" '
                    f'fill="{color}"><title>{layer.index} '
                    f"{_e(layer.type_name)} {name}: {_tick_label(v, unit, scale)}</title></rect>"
                )
                base += v
        if n <= 60 or i % math.ceil(n / 60) == 0:
            lx, ly = x_of(i) + step / 2, height - foot + 10
            parts.append(
                f'<text x="{lx:.1f}" y="{ly}" font-size="9" text-anchor="end" '
                f'transform="rotate(-60 {lx:.1f} {ly})" fill="#444">'
                f"{i} {_e(layer.type_name)}</text>"
            )
    return _svg(width, height, parts, label)


def _layer_memory_chart(plan: Plan) -> str:
    series = [
        ([float(x.params_bytes) for x in plan.layers], "parameters", PARTS[0][2]),
        (
            [float(x.grads_bytes + x.optimizer_bytes) for x in plan.layers],
            "gradients + optimizer",
            "#f0a35e",
        ),
        (
            [float(x.activation_bytes) for x in plan.layers],
            "activations (whole batch)",
            PARTS[3][2],
        ),
    ]
    return _layer_chart(plan, series, _axis, "memory per layer")


def _layer_time_chart(plan: Plan) -> str:
    if not plan.profile.timed:
        return f'<p class="meta">Not measured: the profile ran on {_e(plan.profile.device)}.</p>'

    def ms_axis(top: float) -> tuple[str, int, list[float]]:
        raw = top / 5
        base = 10 ** math.floor(math.log10(raw))
        step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)
        return "ms", 1, [i * step for i in range(math.ceil(top / step) + 1)]

    series = [
        ([x.forward_ms or 0.0 for x in plan.layers], "forward", "#4e79a7"),
        ([x.backward_ms or 0.0 for x in plan.layers], "backward", "#9c755f"),
    ]
    legend = _legend([("", "forward", "#4e79a7"), ("", "backward", "#9c755f")])
    return legend + _layer_chart(plan, series, ms_axis, "time per layer")


def _stage_table(plan: Plan) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in [
            "stage",
            "device",
            "layers",
            "params",
            "grads",
            "optimizer",
            "activations",
            "temporaries",
            "peak",
            "capacity",
            "headroom",
            "in flight",
            "peak during",
            "time ms",
        ]
    )
    rows = []
    for s in plan.stages:
        cap = format_bytes(s.capacity_bytes) if s.capacity_bytes is not None else "unlimited"
        room = format_bytes(s.headroom_bytes) if s.headroom_bytes is not None else "-"
        cells = [
            str(s.index),
            _e(s.device),
            f"{s.layers.start}..{s.layers.stop - 1}",
            *(format_bytes(getattr(s, f)) for f, _, _ in PARTS),
            format_bytes(s.peak_bytes),
            cap,
            room,
            f"x{s.in_flight}",
            s.phase,
            "-" if s.time_ms is None else f"{s.time_ms:.2f}",
        ]
        tds = "".join(
            f'<td class="n">{c}</td>' if i > 2 else f"<td>{c}</td>" for i, c in enumerate(cells)
        )
        rows.append(f'<tr class="{"" if s.fits else "over"}">{tds}</tr>')
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _layer_table(plan: Plan) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in [
            "#",
            "layer",
            "type",
            "output",
            "params",
            "grads+opt",
            "activations",
            "peak",
            "fwd ms",
            "bwd ms",
            "stage",
        ]
    )
    rows = []
    for x in plan.layers:
        cells = [
            str(x.index),
            _e(x.name),
            _e(x.type_name),
            _e(shape_text(x.output_shape)),
            format_bytes(x.params_bytes),
            format_bytes(x.grads_bytes + x.optimizer_bytes),
            format_bytes(x.activation_bytes),
            format_bytes(x.peak_bytes),
            "-" if x.forward_ms is None else f"{x.forward_ms:.2f}",
            "-" if x.backward_ms is None else f"{x.backward_ms:.2f}",
            str(plan.stage_of(x.index)),
        ]
        tds = "".join(
            f'<td class="n">{c}</td>' if i > 3 else f"<td>{c}</td>" for i, c in enumerate(cells)
        )
        rows.append(f"<tr>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"
