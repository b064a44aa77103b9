"""This rank's arguments of ``ppd.wrap``, checked on their own before any communication.

(:mod:`~pipepar.ranks.handshake` then checks that all ranks passed the same ones.)
"""

from __future__ import annotations

import math

from torch import nn

from pipepar.core import validation
from pipepar.core.named_schedules import NAMES, make, n_workers
from pipepar.core.schedule import Schedule

__all__ = ["SCHEDULES", "check_model", "check_schedule", "check_timeout"]

SCHEDULES = NAMES
"""The schedules ``wrap`` accepts by name (the same as ``pipepar.wrap``)."""


def check_model(model: object, balance: object) -> tuple[nn.Sequential, list[int]]:
    """The model as an ``nn.Sequential`` and its balance, which must be given explicitly.

    Example:
        >>> check_model(nn.Sequential(nn.ReLU(), nn.ReLU()), [1, 1])[1]
        [1, 1]
    """
    model = validation.check_model(model, "model")
    if balance is None:
        raise ValueError(
            "balance=None cannot be profiled across ranks; pass balance=pipepar.plan(model, "
            f"sample, devices=N).balance or e.g. balance={[len(model)]}"
        )
    checked = validation.check_balance(balance, len(model))
    validation.check_unique_layers(model)
    validation.check_shared_parameters(model, checked)
    return model, checked


def check_schedule(schedule: str | Schedule, n_stages: int, chunks: int) -> Schedule:
    """The schedule named by ``schedule`` (or ``schedule`` itself, validated) for the grid.

    Example:
        >>> check_schedule("1f1b", 2, 4).name
        '1f1b'
        >>> check_schedule("zb-v", 4, 4).n_workers
        2
    """
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(
            f"schedule must be a name or a pipepar Schedule, but got {type(schedule).__name__}; "
            "pass e.g. schedule='1f1b'"
        )
    workers = n_workers(schedule, n_stages, per="rank")
    built = make(schedule, n_stages, chunks, n_workers=workers)
    _check_orders(built)
    return built


def _check_orders(schedule: Schedule) -> None:
    """Point-to-point messages match in order: all stages must walk micro-batches alike.

    Stage ``s`` sends its outputs in the order of its F actions and stage ``s+1`` receives them
    in the order of its own, on one channel per receiving stage; gradients likewise in B order.
    So neighbouring stages, hence all stages, must take the micro-batches in one order per kind.
    """
    orders = {
        kind: [
            [a.microbatch for a in schedule.stage(j) if a.kind == kind]
            for j in range(schedule.n_stages)
        ]
        for kind in ("F", "B")
    }
    for kind, per_stage in orders.items():
        for j, order in enumerate(per_stage):
            if order != per_stage[0]:
                raise ValueError(
                    f"stage {j} runs its {kind} actions in order {order} but stage 0 in "
                    f"{per_stage[0]}; every stage must take micro-batches in the same order"
                )


def check_timeout(timeout: object) -> float | None:
    """``timeout`` in seconds as a float, or ``None`` (no limit); a number must be positive.

    Example:
        >>> check_timeout(30)
        30.0
        >>> check_timeout(None) is None
        True
    """
    if timeout is None:
        return None
    number = timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else 0
    if not 0 < number < math.inf:
        raise ValueError(
            f"timeout must be a positive number of seconds or None (no limit), but got "
            f"{timeout!r}; e.g. timeout=300"
        )
    return float(number)
