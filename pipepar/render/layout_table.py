"""Layouts from :func:`pipepar.search_layouts` as a terminal table (rich), fastest first.

Its ``dp state`` column says whether the replicas shard each stage's state (``sharded``:
``pipepar.distributed.wrap(..., dp_shard=True)``) or hold it whole (``replicated``).

A layout is data (:meth:`pipepar.Layout.to_dict`); this reads it.

>>> print(render_layouts(pipepar.search_layouts(prof, devices=64, batch=512, cluster="h100x8")))
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from pipepar.core.units import format_bytes
from pipepar.render.report import duration_text

if TYPE_CHECKING:
    from pipepar.planner.layout import Layout

__all__ = ["balance_text", "render_layouts"]

_COLUMNS = [
    ("#", "right"),
    ("pp", "right"),
    ("dp", "right"),
    ("dp state", "left"),
    ("schedule", "left"),
    ("chunks", "right"),
    ("rows/mb", "right"),
    ("recompute", "left"),
    ("balance", "left"),
    ("step", "right"),
    ("rows/s", "right"),
    ("bubble", "right"),
    ("peak / capacity", "right"),
]


def balance_text(balance: Sequence[int], *, most: int = 8) -> str:
    """A balance in a few characters: the list when short, else the stages and their sizes.

    Example:
        >>> balance_text([5, 5, 6]), balance_text([5] * 15 + [6])
        ('[5, 5, 6]', '16 stages of 5-6')
    """
    if len(balance) <= most:
        return str(list(balance))
    low, high = min(balance), max(balance)
    sizes = str(low) if low == high else f"{low}-{high}"
    return f"{len(balance)} stages of {sizes}"


def _state(dp: int, shard: bool) -> str:
    """How the replicas hold each stage's state: ``"sharded"``, ``"replicated"``, or ``"-"``
    without replicas."""
    if dp == 1:
        return "-"
    return "sharded" if shard else "replicated"


def render_layouts(layouts: Sequence[Layout], *, width: int = 160, color: bool = False) -> str:
    """The layouts as a table, one row each in the order given (the search's: fastest first).

    Args:
        layouts: what :func:`pipepar.search_layouts` returned.
        width: the console width in characters.
        color: keep ANSI colors (for a terminal) or not (for files and logs).

    Returns:
        The rendered text.
    """
    title = "Layouts, fastest first"
    if layouts:
        first = layouts[0]
        title += (
            f" ({first.pp * first.dp} devices of {format_bytes(first.capacity_bytes)}, "
            f"{first.rows * first.dp} rows per step, {first.prediction.cluster})"
        )
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for name, justify in _COLUMNS:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for i, x in enumerate(layouts):
        peak = max(x.peak_bytes)
        table.add_row(
            str(i + 1),
            str(x.pp),
            str(x.dp),
            _state(x.dp, x.dp_shard),
            x.schedule,
            str(x.chunks),
            str(x.plan.micro_batch_rows),
            x.checkpoint + (", offload" if x.offload else ""),
            balance_text(x.balance, most=6),
            duration_text(x.step_ms),
            f"{x.throughput:.4g}",
            f"{x.bubble:.1%}",
            f"{format_bytes(peak)} / {format_bytes(x.capacity_bytes)} "
            f"({peak / x.capacity_bytes:.0%})",
        )
    out = io.StringIO()
    console = Console(
        file=out, width=width, color_system="standard" if color else None, force_terminal=color
    )
    console.print(table)
    return out.getvalue()
