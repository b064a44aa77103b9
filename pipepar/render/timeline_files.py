"""A timeline written to a file in the format its name's suffix gives: .svg, .png, .html, .json.

It reads the drawings (:mod:`pipepar.render.timeline`) and the HTML page
(:mod:`pipepar.render.timeline_html`); neither knows about it, nor about the others' files.
Users call it as :func:`pipepar.timeline.save`.

    >>> from pipepar import timeline
    >>> timeline.save(pipe.tracer, "pipeline.png")    # .svg, .html, or .json for ui.perfetto.dev
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipepar.recording.tracer import Timeline, Tracer
from pipepar.render.timeline import save_chrome_trace, save_png, save_svg
from pipepar.render.timeline_html import save_html

__all__ = ["SUFFIXES", "save"]

SUFFIXES = (".svg", ".png", ".html", ".json")
"""The file names :func:`save` understands."""


def save(source: Timeline | Tracer, path: str | Path, **options: Any) -> Path:
    """Write the timeline in the format its suffix names: .svg, .png, .html or .json.

    Args:
        source: a :class:`~pipepar.Timeline` or the pipe's
            :class:`~pipepar.tracing.tracer.Tracer`.
        path: where to write; ``.json`` is a Chrome trace (Perfetto), ``.html`` a page with the
            last mini-batch's chart and a table per stage, the others a Gantt chart.
        **options: ``width=`` and ``title=`` for the charts and the page.

    Returns:
        The path written.

    Raises:
        ValueError: a suffix not in :data:`SUFFIXES`.
        TypeError: drawing options given for a ``.json`` Chrome trace.

    Example:
        >>> save(pipe.tracer, "out.png")
        PosixPath('out.png')
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        return save_svg(source, path, **options)
    if suffix == ".png":
        return save_png(source, path, **options)
    if suffix == ".html":
        return save_html(source, path, **options)
    if suffix == ".json":
        if options:
            raise TypeError(f"a Chrome trace takes no drawing options, got {sorted(options)}")
        return save_chrome_trace(source, path)
    raise ValueError(
        f"cannot tell the format of {str(path)!r} from its suffix {suffix or '(none)'!r}; "
        "name it .svg or .png (Gantt chart), .html (chart and table) or .json (Chrome trace "
        "for Perfetto)"
    )
