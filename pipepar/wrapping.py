"""``pipepar.wrap``: an ``nn.Sequential`` becomes a :class:`~pipepar.local.pipe.Pipe`, any other
model a :class:`~pipepar.program.pipe.ModelPipe` (:func:`pipepar.program.wrap.wrap_model`).

Above both routes: neither pipe knows about the other, nor about this choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.devices import DeviceSpec
from pipepar.core.microbatch import Value
from pipepar.core.schedule import Schedule
from pipepar.local.pipe import Pipe
from pipepar.planner.plan import plan
from pipepar.planner.profile import profile
from pipepar.program.wrap import wrap_model

__all__ = ["wrap"]


def wrap(
    module: nn.Module,
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
) -> Any:
    """Split ``module`` into pipeline stages and return the pipe.

    An ``nn.Sequential`` becomes a :class:`Pipe` (the same arguments as ``torchgpipe.GPipe``);
    any other model a :class:`~pipepar.program.pipe.ModelPipe`, called with the model's own
    arguments and returning what the model returns, its forward code cut into stages as it
    runs. With ``balance=None`` and ``split=None`` the model is profiled on ``sample`` and
    split by :func:`pipepar.plan` to fit ``capacity``.

    Args:
        module: the model to split; its layers are moved to their stage's device.
        balance: layers (units, for other models: see :func:`pipepar.units`) per stage, e.g.
            ``[3, 3, 2]``; ``None`` to use ``split`` or to plan it from ``sample``.
        split: module paths where a new stage begins, e.g. ``["transformer.h.6"]``.
        devices: one device per stage; ``None`` = all CUDA devices, or the CPU for every stage.
        chunks: micro-batches per mini-batch (M).
        checkpoint: which micro-batches recompute their activations in backward:
            ``"always"``, ``"except_last"`` (the default for ``nn.Sequential``, as in
            torchgpipe) or ``"never"`` (the default for other models, which then recompute
            unit by unit: each unit keeps its arguments and runs again in backward, drawing
            the same random numbers).
        deferred_batch_norm: track batch-norm statistics over the whole mini-batch.
        sample: an input batch to profile when ``balance`` is None: a tensor, a tuple of
            positional arguments, or a dict of keyword arguments (``dict(input_ids=...)``).
        capacity: bytes per device for planning (int, ``"16GiB"``, or one per device).
        threads: math threads per CPU stage; default: ``torch.get_num_threads()`` shared among
            the CPU stages that compute at once on average (``round(K*M/(M+K-1))``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``, ``"zb-v"`` or a
            :class:`~pipepar.core.schedule.Schedule`. The last two place several stages on
            each device: ``balance`` then lists 2 (or more) stages per device. Their memory
            bound and bubble apply to :meth:`Pipe.step`; ``pipe(x)`` runs all forwards first.
        trace: record a timeline of every action in ``pipe.tracer``.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
        >>> pipe = pipepar.wrap(model, [4, 4], devices=["cpu", "cpu"], chunks=4)
        >>> pipe(torch.randn(32, 16)).sum().backward()
    """
    if not isinstance(module, nn.Sequential) or split is not None or isinstance(sample, dict):
        return wrap_model(
            module,
            balance,
            devices=devices,
            chunks=chunks,
            checkpoint=checkpoint,
            deferred_batch_norm=deferred_batch_norm,
            sample=sample,
            split=split,
            capacity=capacity,
            schedule=schedule,
            threads=threads,
            trace=trace,
        )
    checkpoint = "except_last" if checkpoint is None else validation.check_checkpoint(checkpoint)
    if balance is None:
        balance = _planned_balance(module, sample, devices, capacity, chunks, checkpoint, schedule)
    return Pipe(
        module,
        balance,
        devices=devices,
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        schedule=schedule,
        threads=threads,
        trace=trace,
    )


def _planned_balance(
    module: nn.Sequential,
    sample: Value | None,
    devices: DeviceSpec,
    capacity: Any,
    chunks: int,
    checkpoint: str,
    schedule: str | Schedule,
) -> list[int]:
    module = validation.check_model(module)
    if sample is None:
        raise ValueError(
            "balance is None and no sample was given; pass balance=[...] (layers per stage) or "
            "sample=<an input batch> so pipepar can profile the model and plan the split"
        )
    param = next(module.parameters(), None)
    where = param.device if param is not None else torch.device("cpu")
    n_devices = devices if devices is not None else (torch.cuda.device_count() or 1)
    prof = profile(module, sample, device=str(where))
    return list(
        plan(
            prof,
            devices=n_devices,
            capacity=capacity,
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            optimizer=None,
        ).balance
    )
