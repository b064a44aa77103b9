"""MkDocs hooks (mkdocs.yml ``hooks:``): the benchmark pages read benchmarks/RESULTS.md.

Benchmarks write their figures into benchmarks/RESULTS.md (``benchmarks/_results.py``), one
``## title`` section each, headed by the command that made them; sessions add analyses by hand
beside them. The docs show that file in two pages without copying it: a page holding the
marker ``<!-- results: latest -->`` gets every section a benchmark wrote (it has a
``Command:`` line), the page holding ``<!-- results: history -->`` gets the analyses written by
hand (sections without a command, and ``### ... (analysis)`` notes inside written sections),
so a rerun of a benchmark shows up in the next build and nothing of the file is left out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"
LATEST = "<!-- results: latest -->"
HISTORY = "<!-- results: history -->"
_COMMAND = re.compile(r"^Command: `", re.M)


def _split(text: str, level: str) -> tuple[str, list[str]]:
    """The text before the first heading of ``level`` (``"## "``), and each such section."""
    parts = re.split(rf"^(?={re.escape(level)})", text, flags=re.M)
    return parts[0], parts[1:]


def results_pages(text: str) -> tuple[str, str]:
    """RESULTS.md's text divided into (the benchmarks' latest sections, the analyses)."""
    _, sections = _split(text, "## ")
    latest: list[str] = []
    history: list[str] = []
    for section in sections:
        if not _COMMAND.search(section):
            history.append(section)
            continue
        head, subsections = _split(section, "### ")
        kept = [head]
        title = section.splitlines()[0][3:]
        for sub in subsections:
            if "(analysis)" in sub.splitlines()[0]:
                history.append(f'{sub.rstrip()}\n\n(A note on "{title}".)\n\n')
            else:
                kept.append(sub)
        latest.append("".join(kept))
    return "".join(latest), "".join(history)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Put RESULTS.md's sections where a page asks for them."""
    if LATEST not in markdown and HISTORY not in markdown:
        return markdown
    latest, history = results_pages(RESULTS.read_text(encoding="utf-8"))
    return markdown.replace(LATEST, latest).replace(HISTORY, history)
