"""A measured pipeline timeline as HTML: a section to embed, or a page of its own.

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

from pipepar.render.timeline import as_timeline, to_svg
from pipepar.tracing.tracer import COMPUTE, Timeline, Tracer

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
    source: Timeline | Tracer, *, width: int = 1000, heading: str = "Measured pipeline timeline"
) -> str:
    """``<h2>``, a summary line, the chart of the last mini-batch and the per-stage table."""
    step, count = last_step(source)
    note = f"last of {count} mini-batches" if count > 1 else "one mini-batch"
    meta = (
        f'<div class="meta">{note} &middot; {step.n_stages} stages x {step.n_microbatches} '
        f"micro-batches &middot; span {step.span * 1e3:.2f} ms &middot; measured bubble "
        f"{step.bubble:.1%} (schedule bound (K-1)/(M+K-1) = {step.ideal_bubble:.1%})</div>"
    )
    chart = to_svg(step, width=width)
    return "\n".join([f"<h2>{html.escape(heading)}</h2>", meta, chart, table(step)])


def table(step: Timeline) -> str:
    """Milliseconds per stage in each kind of event, and the idle share of the span."""
    head = "".join(f"<th>{c} ms</th>" for c in _COLUMNS)
    rows = [f"<tr><th>stage</th>{head}<th>idle</th></tr>"]
    for j in range(step.n_stages):
        cells = [step.busy(j)] + [step.seconds(j, c) for c in _COLUMNS[1:]]
        idle = 1.0 - cells[0] / step.span if step.span > 0 else 0.0
        tds = "".join(f"<td>{v * 1e3:.2f}</td>" for v in cells)
        rows.append(f"<tr><td>{j}</td>{tds}<td>{idle:.1%}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


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
