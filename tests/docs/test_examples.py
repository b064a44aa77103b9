"""Every Python example of README.md and docs/ runs, so the docs cannot drift from the code.

A page's fenced ``python`` blocks run in order in one namespace (a later block may use what an
earlier one built, as a reader does), from a fresh temporary directory, on the CPU. A block
whose first line is ``# not run: <reason>`` (one that needs torchrun, GPUs or data of your
own) is shown to the reader with that reason and only compiled here. The examples themselves
use tiny sizes, so the whole file runs in well under a minute on two cores.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block: its code, the line it starts on, why it is not run."""

    code: str
    line: int
    not_run: str | None


def blocks(page: Path) -> list[Block]:
    """The page's ``python`` blocks in order."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        code = match.group(1)
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        reason = _NOT_RUN.fullmatch(first.strip())
        line = text.count("\n", 0, match.start(1)) + 1
        found.append(Block(code, line, reason.group(1) if reason else None))
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


WITH_EXAMPLES = [p for p in PAGES if blocks(p)]


@pytest.mark.parametrize("page", WITH_EXAMPLES, ids=_name)
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's runnable blocks run in order; the others compile."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    for block in blocks(page):
        where = f"{_name(page)}:{block.line}"
        compiled = compile(block.code, where, "exec")
        if block.not_run is None:
            try:
                exec(compiled, namespace)
            except Exception as error:  # the page and line, then the example's own error
                raise AssertionError(f"the example at {where} failed: {error!r}") from error


def test_not_run_blocks_say_why() -> None:
    """A block marked not run gives a reason a reader can act on, and most blocks run."""
    marked = [b for p in PAGES for b in blocks(p) if b.not_run is not None]
    total = sum(len(blocks(p)) for p in PAGES)
    assert all(len(b.not_run or "") >= 10 for b in marked), [b.not_run for b in marked]
    assert total and len(marked) <= total // 2, f"{len(marked)} of {total} blocks are not run"


def test_readme_quick_start_is_found_as_check_wheel_reads_it() -> None:
    """scripts/check_wheel.sh runs the block right after "## Quick start"; it must stay runnable."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S)
    assert quick is not None and not _NOT_RUN.match(quick.group(1).lstrip())
    assert "ckpt.pt" in quick.group(1)  # check_wheel.sh checks that the file was written
