"""A griffe extension for the docs site (mkdocs.yml): pipepar's docstrings read as Markdown.

pipepar's docstrings head their doctests ``Example:``, which the Google style allows and ruff
accepts; griffe's Google parser knows only ``Examples:`` as the section whose ``>>>`` lines it
renders as code (it reads ``Example:`` as an admonition of prose, where ``['0', '1']`` turns
into a broken link). They also name other objects with Sphinx roles
(``:class:`~pipepar.Plan` ``), which Markdown would show as they are typed. When griffe loads a
docstring, the heading is renamed and each role becomes the code span of the name it shows
(the last part after ``~``), so the sources stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    """The code span a Sphinx role shows: ``~a.b.C`` as ``C``, ``a.b.C`` whole."""
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown(docstring: str) -> str:
    """``docstring`` with ``Example:`` headings as ``Examples:`` and Sphinx roles as code."""
    return _ROLE.sub(_role, _HEADING.sub(r"\1Examples:", docstring))


class MarkdownDocstrings(griffe.Extension):
    """Rewrite the docstrings griffe loads with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
