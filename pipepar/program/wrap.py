"""``pipepar.wrap`` for any model: plan the stages from a sample when none are given, build the
:class:`~pipepar.program.pipe.ModelPipe`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.devices import DeviceSpec
from pipepar.core.schedule import Schedule
from pipepar.program.pipe import ModelPipe

__all__ = ["wrap_model"]


def wrap_model(
    model: nn.Module,
    balance: Sequence[int] | None = None,
    *,
    devices: DeviceSpec = None,
    chunks: int = 1,
    checkpoint: str | None = None,
    deferred_batch_norm: bool = False,
    sample: Any = None,
    split: Sequence[str] | None = None,
    capacity: Any = None,
    schedule: str | Schedule = "gpipe",
    threads: int | None = None,
    trace: bool = False,
) -> ModelPipe:
    """:func:`pipepar.wrap` for any model that is not an ``nn.Sequential`` (or is split by
    module paths): see there."""
    checkpoint = "never" if checkpoint is None else validation.check_checkpoint(checkpoint)
    if balance is None and split is None:
        balance = _planned_units(model, sample, devices, capacity, chunks, schedule, checkpoint)
    return ModelPipe(
        model,
        balance,
        split=split,
        devices=devices,
        chunks=chunks,
        sample=sample,
        schedule=schedule,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        threads=threads,
        trace=trace,
    )


def _planned_units(
    model: nn.Module,
    sample: Any,
    devices: DeviceSpec,
    capacity: Any,
    chunks: int,
    schedule: str | Schedule,
    checkpoint: str,
) -> list[int]:
    if sample is None:
        raise ValueError(
            "balance and split are None and no sample was given; pass split=[module paths "
            "where stages begin], balance=[units per stage] (pipepar.units(model) lists the "
            "units), or sample=<an input batch> so pipepar can profile the model and plan"
        )
    from pipepar.planner.plan import plan
    from pipepar.program.profile import profile_model

    param = next(model.parameters(), None)
    where = param.device if param is not None else torch.device("cpu")
    n_devices = devices if devices is not None else (torch.cuda.device_count() or 1)
    prof = profile_model(model, sample, device=str(where))
    chosen = plan(
        prof,
        devices=n_devices,
        capacity=capacity,
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        optimizer=None,
    )
    return list(chosen.balance)
