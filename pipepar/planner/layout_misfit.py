"""Why no layout fits, said so the user can act: about the least capacity one needs and how
much more that is, or, where no shape was even tried, what ruled each out.

The need is found for the schedule that holds the least of those searched (1F1B, the usual
yardstick, else the others in :data:`LEAN`'s order), at the most micro-batches, the most frugal
recompute and offload where it may be tried: the split with the smallest largest stage, as
:func:`pipepar.plan` requires each device's stages within its share.

    >>> raise ValueError(nothing_fits(shapes, fits, schedules=["1f1b"], checkpoint="always",
    ...                               offloads=[False]))
"""

from __future__ import annotations

from pipepar.core.units import format_bytes
from pipepar.planner.layout_fit import Fits, per_device
from pipepar.planner.layout_shape import Shape, Shapes
from pipepar.planner.plan_search import unconstrained
from pipepar.planner.plan_targets import Target
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["LEAN", "nothing_fits"]

LEAN = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "v-min", "v-half")
"""Schedules whose need is told when nothing fits, the first of them searched: 1F1B's (the
usual yardstick), else the rest's (v-min and v-half hold less, with two stages per device)."""


def nothing_fits(
    shapes: Shapes, fits: Fits, *, schedules: list[str], checkpoint: str, offloads: list[bool]
) -> str:
    """Why no layout of ``shapes`` fits: the least capacity one needs, or what ruled each
    ``pp`` out (``shapes.skipped``).

    Args:
        shapes: the search's shapes, walked.
        fits: the search's plans (its schedules are reused).
        schedules: the schedules searched.
        checkpoint: the most frugal recompute policy searched.
        offloads: whether layouts were tried without offload and with it, in that order.
    """
    what = (
        f"no layout fits {shapes.devices} devices of {format_bytes(shapes.capacity)} with a "
        f"batch of {shapes.rows} rows"
    )
    fixes = "use larger or more devices, a smaller batch, or an optimizer with less state"
    if shapes.cluster.host is None and True not in offloads:
        fixes += " (activation offload is not tried: these devices' memory is the host's)"
    least = _least_needed(shapes, fits, schedules, checkpoint, offloads[-1])
    if least is None:
        return f"{what}: {'; '.join(shapes.skipped) or 'nothing to try'}; {fixes}"
    need, shape, memory = least
    order = memory.schedule
    return (
        f"{what}: the least any needs is about {format_bytes(need)} per device (pp="
        f"{shape.pp}, dp={shape.dp}{' sharded' if shape.shard else ''}, {order.name}, "
        f"{order.n_microbatches} micro-batches, "
        f"checkpoint={memory.checkpoint!r}{', offload' if memory.offload else ''}), "
        f"{format_bytes(need - shapes.capacity)} more; "
        f"{fixes}"
    )


def _least_needed(
    shapes: Shapes, fits: Fits, schedules: list[str], checkpoint: str, offload: bool
) -> tuple[int, Shape, MemoryModel] | None:
    """About the least capacity a layout needs: with the schedule that holds the least
    (1F1B, of those searched), the most micro-batches, ``checkpoint`` and ``offload``. Each
    ``pp`` costs a search of its own, so they go from the least parameter bytes per
    device (a lower bound of the need) up, while that bound is below the least found."""
    name = next((n for n in LEAN if n in schedules), "v-min")
    best: tuple[int, Shape, MemoryModel] | None = None
    tried = shapes.tried
    bounds = {key: shapes.state_bytes(dp, key[1]) / key[0] for key, (dp, _) in tried.items()}
    for pp, shard in sorted(tried, key=lambda key: bounds[key]):
        if best is not None and bounds[(pp, shard)] >= best[0]:
            break
        if pp * per_device(name) > len(shapes.prof):
            continue
        shape = shapes.shape(pp, *tried[(pp, shard)], shard)
        order = fits.schedule(name, pp, shapes.chunk_counts(shape)[0])
        foreach = [t.foreach for t in shape.targets]
        memory = MemoryModel(
            shape.profile,
            order,
            checkpoint=checkpoint,
            foreach=foreach,
            offload=offload,
            ranks=fits.ranks,
        )
        need = _needed(memory, foreach[0])
        if best is None or need < best[0]:
            best = (need, shape, memory)
    return best


def _needed(memory: MemoryModel, foreach: bool) -> int:
    """The least capacity a schedule needs: the split with the smallest largest stage, a
    device's stages each within its share of it, as :func:`pipepar.plan` requires."""
    order = memory.schedule
    bare = [Target(f"stage {s}", 0, foreach) for s in range(order.n_stages)]
    split = unconstrained(memory, bare)
    return order.n_stages // order.n_workers * max(c.peak for c in split)
