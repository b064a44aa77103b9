"""A plan as a terminal table (rich); the plan's plain data (JSON) is its own
(:meth:`pipepar.Plan.to_dict`).

>>> print(pipepar.report.table(plan))    # one row per layer, one per stage, totals
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from pipepar.core.units import format_bytes
from pipepar.render.step_gantt import gantt_lines

if TYPE_CHECKING:
    from pipepar.planner.plan import Plan

__all__ = ["duration_text", "prediction_text", "render_report", "shape_text"]


def shape_text(shape: Any) -> str:
    """``(64, 3, 224, 224)`` -> ``"64x3x224x224"``; tuple outputs joined with ``", "``.

    Example:
        >>> shape_text(((8, 16), (8,)))
        '8x16, 8'
    """
    if not shape:
        return "-"
    if all(isinstance(d, int) for d in shape):
        return "x".join(str(d) for d in shape)
    return ", ".join(shape_text(s) for s in shape)


def duration_text(ms: float) -> str:
    """A duration in ms as text: ``"850 ms"``, ``"12.3 s"``.

    Example:
        >>> duration_text(850.0), duration_text(12345.0)
        ('850 ms', '12.3 s')
    """
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1e3:.3g} s"


def prediction_text(plan: Plan) -> str | None:
    """The plan's predicted step in one line, or None when it has no prediction.

    Example:
        >>> prediction_text(layouts[0].plan).startswith("predicted step on h100x8 (dp=")
        True
    """
    pred = plan.prediction
    if pred is None:
        return None
    source = "times from FLOPs" if pred.source == "flops" else "measured times"
    if pred.dp_shard:
        gather = max(pred.gather_ms, default=0.0)
        return (
            f"predicted step on {pred.cluster} (dp={pred.dp}, state sharded, {source}): "
            f"{duration_text(pred.step_ms)}, bubble {pred.bubble:.1%}, weights' all-gather "
            f"{duration_text(gather)} before the first action, reduce-scatter exposed "
            f"{duration_text(pred.exposed_allreduce_ms)}"
        )
    return (
        f"predicted step on {pred.cluster} (dp={pred.dp}, {source}): "
        f"{duration_text(pred.step_ms)}, bubble {pred.bubble:.1%}, all-reduce exposed "
        f"{duration_text(pred.exposed_allreduce_ms)}"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _layer_table(plan: Plan) -> Table:
    table = Table(
        title=f"Layers (whole batch of {plan.profile.batch_size} rows)", box=box.SIMPLE_HEAD
    )
    for name, justify in [
        ("#", "right"),
        ("layer", "left"),
        ("type", "left"),
        ("output", "left"),
        ("params", "right"),
        ("grads+opt", "right"),
        ("activations", "right"),
        ("peak", "right"),
        ("time ms", "right"),
        ("stage", "right"),
    ]:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for layer in plan.layers:
        table.add_row(
            str(layer.index),
            layer.name,
            layer.type_name,
            shape_text(layer.output_shape),
            format_bytes(layer.params_bytes),
            format_bytes(layer.grads_bytes + layer.optimizer_bytes),
            format_bytes(layer.activation_bytes),
            format_bytes(layer.peak_bytes),
            _ms(layer.time_ms),
            str(plan.stage_of(layer.index)),
        )
    return table


def _stage_table(plan: Plan) -> Table:
    title = (
        f"Stages ({plan.schedule}, {plan.chunks} micro-batches of {plan.micro_batch_rows} rows, "
        f"checkpoint={plan.checkpoint}, optimizer={plan.profile.optimizer}{_shard(plan)})"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD, show_footer=True)
    totals = plan.totals()
    columns = [
        ("stage", "right", "total"),
        ("device", "left", ""),
        ("layers", "left", str(len(plan.layers))),
        ("params", "right", format_bytes(totals["params_bytes"])),
        ("grads", "right", format_bytes(totals["grads_bytes"])),
        ("optimizer", "right", format_bytes(totals["optimizer_bytes"])),
        ("activations", "right", format_bytes(totals["activation_bytes"])),
        ("transient", "right", format_bytes(totals["transient_bytes"])),
        ("peak", "right", format_bytes(totals["peak_bytes"])),
        ("capacity", "right", ""),
        ("headroom", "right", ""),
        ("in flight", "right", ""),
        ("time ms", "right", _ms(totals["max_stage_time_ms"])),
    ]
    for name, justify, footer in columns:
        table.add_column(name, justify=justify, footer=footer, no_wrap=True)  # type: ignore[arg-type]
    for s in plan.stages:
        headroom = s.headroom_bytes
        room = format_bytes(headroom) if headroom is not None else "-"
        table.add_row(
            str(s.index),
            s.device,
            f"{s.layers.start}..{s.layers.stop - 1}",
            format_bytes(s.params_bytes),
            format_bytes(s.grads_bytes),
            format_bytes(s.optimizer_bytes),
            format_bytes(s.activation_bytes),
            format_bytes(s.transient_bytes),
            format_bytes(s.peak_bytes),
            format_bytes(s.capacity_bytes) if s.capacity_bytes is not None else "unlimited",
            room if s.fits else f"[red]{room}[/red]",
            f"x{s.in_flight}",
            _ms(s.time_ms),
        )
    return table


def _shard(plan: Plan) -> str:
    """How the state is sharded, if it is: the figures are one rank's of its group."""
    n = plan.profile.shard
    return "" if n == 1 else f", state sharded over {n} ranks: gathered for the step + shards"


def render_report(plan: Plan, *, width: int = 200, color: bool = False) -> str:
    """The plan as text: the layer table, the stage table and a summary line.

    Args:
        plan: the plan to show.
        width: the console width in characters.
        color: keep ANSI colors (for a terminal) or not (for files and logs).

    Returns:
        The rendered text; with the predicted step when the plan has one (a layout's plan),
        and its timeline, a line per worker (:func:`~pipepar.render.step_gantt.gantt_lines`).

    Example:
        >>> "bubble" in render_report(plan)
        True
    """
    out = io.StringIO()
    console = Console(
        file=out, width=width, color_system="standard" if color else None, force_terminal=color
    )
    console.print(_layer_table(plan))
    console.print(_stage_table(plan))
    console.print(_summary(plan), highlight=False)
    predicted = prediction_text(plan)
    if predicted is not None and plan.prediction is not None:
        console.print(predicted, highlight=False)
        gantt = min(80, max(10, width - 60))
        for line in gantt_lines(plan.prediction, width=gantt):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    return out.getvalue()


def _summary(plan: Plan) -> str:
    verdict = "fits" if all(s.fits for s in plan.stages) else "DOES NOT FIT"
    return (
        f"balance {plan.balance}: {verdict}; peak {format_bytes(plan.peak_bytes)}; "
        f"predicted bubble of {plan.schedule} (from its schedule, F = B = W) {plan.bubble:.1%}; "
        f"balanced by {plan.objective}"
    )
