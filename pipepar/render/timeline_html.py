"""A measured pipeline timeline as HTML: a section to embed, or a page of its own.

A predicted step is drawn the same way once it is a timeline
(:func:`pipepar.planner.predicted_timeline.predicted_timeline`): the report passes its own
summary line, and the table gets columns for the data-parallel collectives it shows.

The section holds the Gantt chart (inline SVG from :func:`pipepar.timeline.to_svg`) and a table
of busy, wait and idle time per stage, with the measured bubble beside the schedule's bound.
:func:`pipepar.report.save_html` embeds it next to the planner's prediction; ``.html`` in
:func:`pipepar.timeline.save` writes it as a self-contained page (no scripts, no fetches).

    >>> timeline.save(pipe.tracer, "pipeline.html")
    >>> pipepar.report.save_html(plan, "report.html", timeline=pipe.tracer)
"""

from __future__ import annotations

import html
from pathlib import Path

from pipepar.recording.tracer import COMPUTE, Timeline, Tracer
from pipepar.render.timeline import COLLECTIVES, as_timeline, to_svg

__all__ = ["last_step", "page", "save_html", "section", "table"]

_COLUMNS = ("busy", *COMPUTE, "recompute", "wait", "transfer")
_CSS = (
    "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px;"
    "color:#222;max-width:1200px} h2{font-size:17px} .meta{color:#555;font-size:13px}"
    "table{border-collapse:collapse;font-size:12px;margin-top:6px}"
    "th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}"
)


def last_step(source: Timeline | Tracer) -> tuple[Timeline, int]:
    """The last mini-batch of ``source`` and how many mini-batches it holds."""
    steps = as_timeline(source).steps()
    if not steps:
        raise ValueError(
            "the timeline has no events; run the pipe once with trace=True before drawing it"
        )
    return steps[-1], len(steps)


def section(
    source: Timeline | Tracer,
    *,
    width: int = 1000,
    heading: str = "Measured pipeline timeline",
    summary: str | None = None,
    title: str | None = None,
) -> str:
    """``<h2>``, a summary line, the chart of the last mini-batch and the per-stage table.

    ``summary`` (plain text) replaces the measured figures' line and ``title`` the chart's
    own, e.g. for a predicted step (:mod:`pipepar.planner.predicted_timeline`)."""
    step, count = last_step(source)
    if summary is None:
        note = f"last of {count} mini-batches" if count > 1 else "one mini-batch"
        line = (
            f"{note} &middot; {step.n_stages} stages x {step.n_microbatches} micro-batches "
            f"&middot; span {step.span * 1e3:.2f} ms &middot; measured bubble {step.bubble:.1%} "
            f"(schedule bound (K-1)/(M+K-1) = {step.ideal_bubble:.1%})"
        )
    else:
        line = html.escape(summary)
    meta = f'<div class="meta">{line}</div>'
    chart = to_svg(step, width=width, title=title)
    return "\n".join([f"<h2>{html.escape(heading)}</h2>", meta, chart, table(step)])


def table(step: Timeline) -> str:
    """Milliseconds per stage in each kind of event, and the idle share of the span; the
    data-parallel collectives of a predicted step get columns where they happen."""
    kinds = {e.kind for e in step.events}
    columns = _COLUMNS + tuple(c for c in COLLECTIVES if c in kinds)
    head = "".join(f"<th>{c} ms</th>" for c in columns)
    rows = [f"<tr><th>stage</th>{head}<th>idle</th></tr>"]
    for j in range(step.n_stages):
        cells = [step.busy(j)] + [_seconds(step, j, c) for c in columns[1:]]
        idle = 1.0 - cells[0] / step.span if step.span > 0 else 0.0
        tds = "".join(f"<td>{v * 1e3:.2f}</td>" for v in cells)
        rows.append(f"<tr><td>{j}</td>{tds}<td>{idle:.1%}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _seconds(step: Timeline, stage: int, kind: str) -> float:
    """Seconds stage ``stage`` spent in events of ``kind``, any kind drawn (collectives too)."""
    return sum(e.duration for e in step.events if e.stage == stage and e.kind == kind)


def page(source: Timeline | Tracer, *, width: int = 1000, title: str | None = None) -> str:
    """A self-contained HTML page holding :func:`section`."""
    name = title or "pipepar timeline"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(name)}</title><style>{_CSS}</style></head><body>\n"
        + section(source, width=width, heading=name)
        + "\n</body></html>\n"
    )


def save_html(
    source: Timeline | Tracer, path: str | Path, *, width: int = 1000, title: str | None = None
) -> Path:
    """Write :func:`page` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(page(source, width=width, title=title), encoding="utf-8")
    return path
