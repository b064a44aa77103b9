"""``pipepar.wrap`` for any model: check what only ``nn.Sequential`` pipes support, plan the
stages from a sample when none are given, build the :class:`~pipepar.program.pipe.ModelPipe`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

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
    if checkpoint not in (None, "never"):
        raise ValueError(
            f"checkpoint={checkpoint!r} recomputes whole stages, which pipepar does only for "
            f"nn.Sequential models, and {type(model).__name__} is not one; pass "
            "checkpoint='never' and use the model's own activation checkpointing (for "
            "transformers models: model.gradient_checkpointing_enable())"
        )
    if deferred_batch_norm:
        raise ValueError(
            f"deferred_batch_norm=True works on nn.Sequential models, and "
            f"{type(model).__name__} is not one; pass deferred_batch_norm=False (batch norm "
            "then tracks statistics per micro-batch), or lay the model out with "
            "pipepar.sequentialize first"
        )
    if balance is None and split is None:
        balance = _planned_units(model, sample, devices, capacity, chunks, schedule)
    return ModelPipe(
        model,
        balance,
        split=split,
        devices=devices,
        chunks=chunks,
        sample=sample,
        schedule=schedule,
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
        checkpoint="never",
        schedule=schedule,
        optimizer=None,
    )
    return list(chosen.balance)
