"""The documentation holds what it promises: every benchmark section, every environment switch."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_pages_hold_every_section_once() -> None:
    """The latest page and the archive together hold each section of RESULTS.md exactly once."""
    hooks = _hooks()
    text = hooks.RESULTS.read_text(encoding="utf-8")
    latest, history = hooks.results_pages(text)
    shown = latest + history
    headings = re.findall(r"^#{2,3} .*$", text, re.M)
    assert headings
    for heading in headings:
        assert shown.count(heading + "\n") == text.count(heading + "\n"), heading
    body = [line for line in text.splitlines()[3:] if line.strip()]
    assert all(line in shown for line in body)


def test_written_sections_are_latest_and_notes_history() -> None:
    """A section a benchmark wrote (with its command) is on the latest page; an analysis is not."""
    hooks = _hooks()
    text = (
        "# header\n\n## Bench A\n\nCommand: `python a.py`\n\n| x |\n\n"
        "### Across runs (analysis)\n\nold figures\n\n## Why A moved (analysis)\n\nprose\n"
    )
    latest, history = hooks.results_pages(text)
    assert "## Bench A" in latest and "| x |" in latest and "old figures" not in latest
    assert "### Across runs (analysis)" in history and "## Why A moved" in history
    assert "prose" not in latest


def test_every_environment_switch_is_documented() -> None:
    """Each ``PIPEPAR_*`` variable the library reads has a row in the troubleshooting guide."""
    read = {
        name
        for path in (ROOT / "pipepar").rglob("*.py")
        for name in re.findall(r"PIPEPAR_[A-Z_]+[A-Z]", path.read_text(encoding="utf-8"))
    }
    guide = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text(encoding="utf-8")
    assert read and all(f"| `{name}` |" in guide for name in read), sorted(read)


def test_docstrings_read_as_markdown() -> None:
    """The griffe extension renames ``Example:`` and turns Sphinx roles into code spans."""
    spec = importlib.util.spec_from_file_location(
        "griffe_markdown", ROOT / "scripts" / "griffe_markdown.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "See :class:`~pipepar.Plan` and :func:`pipepar.wrap`.\n\n    Example:\n        >>> 1\n"
    assert (
        module.markdown(text) == "See `Plan` and `pipepar.wrap`.\n\n    Examples:\n        >>> 1\n"
    )
