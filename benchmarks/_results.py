"""Write benchmark tables into benchmarks/RESULTS.md, one section per benchmark.

Each benchmark calls :func:`record` with its section title, a markdown table and the command
that produced it. The section is replaced if it exists, so re-running a benchmark refreshes its
figures instead of piling up copies.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
_HEADER = "# pipepar benchmark results\n\nEach section is written by the benchmark it names.\n"


def machine() -> str:
    """One line naming the machine and the software versions."""
    cpus = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node() or 'host'}: {cpus} CPU cores, {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def command() -> str:
    """The command line that is running now, as a user would type it."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """Render rows as a GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def record(title: str, table: str, *, notes: str = "", path: Path = RESULTS) -> None:
    """Replace (or add) the section ``## title`` in RESULTS.md with this run's table."""
    body = f"## {title}\n\nCommand: `{command()}`\n\nMachine: {machine()}\n\n{table}\n"
    if notes:
        body += f"\n{notes}\n"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: body + "\n", text) if pattern.search(text) else text + "\n" + body
    path.write_text(text)
