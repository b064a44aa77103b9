"""``pipepar.wrap`` for any model: choose the layout from a sample when no stages are given,
build the :class:`~pipepar.program.pipe.ModelPipe`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipepar.core import validation
from pipepar.core.devices import DeviceSpec
from pipepar.core.schedule import Schedule
from pipepar.planner.auto_layout import keep_layout, local_layout, pipe_arguments
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.program.pipe import ModelPipe

__all__ = ["wrap_model"]


def wrap_model(
    model: nn.Module,
    balance: Sequence[int] | None = None,
    *,
    devices: DeviceSpec = None,
    chunks: int | None = None,
    checkpoint: str | None = None,
    deferred_batch_norm: bool = False,
    sample: Any = None,
    split: Sequence[str] | None = None,
    capacity: Any = None,
    schedule: str | Schedule | None = None,
    threads: int | None = None,
    trace: bool = False,
    runtime: RuntimeFit | None = None,
) -> ModelPipe:
    """:func:`pipepar.wrap` for any model that is not an ``nn.Sequential`` (or is split by
    module paths): see there. Without ``balance`` and ``split`` the layout is searched from
    ``sample`` (the values given fixed) and kept as ``pipe.layout``; else ``pipe.layout`` is
    None.

    Example:
        >>> pipe = wrap_model(model, sample=dict(input_ids=ids), devices=["cpu", "cpu"])
        >>> pipe.layout.balance  # doctest: +SKIP
        (6, 7)
    """
    layout = None
    if balance is None and split is None:
        layout = local_layout(
            model,
            _sample_to_plan(sample),
            devices=devices,
            capacity=capacity,
            schedule=schedule,
            chunks=chunks,
            checkpoint=checkpoint,
            runtime=runtime,
        )
        balance, chunks, checkpoint, schedule = pipe_arguments(layout, schedule)
    pipe = ModelPipe(
        model,
        balance,
        split=split,
        devices=devices,
        chunks=1 if chunks is None else chunks,
        sample=sample,
        schedule="gpipe" if schedule is None else schedule,
        checkpoint="never" if checkpoint is None else validation.check_checkpoint(checkpoint),
        deferred_batch_norm=deferred_batch_norm,
        threads=threads,
        trace=trace,
    )
    keep_layout(pipe, layout)
    return pipe


def _sample_to_plan(sample: Any) -> Any:
    """``sample``, which a searched layout needs; else the ValueError with the fix."""
    if sample is None:
        raise ValueError(
            "balance and split are None and no sample was given; pass split=[module paths "
            "where stages begin], balance=[units per stage] (pipepar.units(model) lists the "
            "units), or sample=<an input batch> so pipepar can profile the model and choose "
            "the layout"
        )
    return sample
