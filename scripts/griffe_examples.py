"""A griffe extension for the docs site (mkdocs.yml): read ``Example:`` as an examples section.

pipepar's docstrings head their doctests ``Example:``, which the Google style allows and ruff
accepts; griffe's Google parser knows only ``Examples:`` as the section whose ``>>>`` lines it
renders as code (it reads ``Example:`` as an admonition of prose, where ``['0', '1']`` turns
into a broken link). Renaming the heading when griffe loads a docstring keeps the sources as
they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    """Rename every ``Example:`` heading to ``Examples:`` in the docstrings griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring heading, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
