"""``memory_budget=`` of ``pipepar.wrap`` and ``pipepar.distributed.wrap`` with
``schedule="auto"``: the forms a budget is given in (micro-batches, a share of 1F1B's, bytes)
read into one per-device bound, checked against the least any schedule holds, and the schedule
built for it (:mod:`pipepar.core.schedule_budget`).

Every rank reads the same arguments into the same bound and builds the same schedule (the
search is deterministic), so ranks need not send it to each other; the handshake compares the
action lists all the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pipepar.core.schedule import Schedule
from pipepar.core.schedule_budget import budget_schedule, least_budget, one_f_one_b_held
from pipepar.core.units import format_bytes, parse_bytes

__all__ = ["AUTO", "auto_schedule", "for_budget", "refuse_searched"]

AUTO = "auto"
"""The schedule name that builds the fastest schedule within ``memory_budget``."""


def auto_schedule(
    schedule: str | Schedule | None,
    memory_budget: float | str | None,
    *,
    n_stages: int | None,
    chunks: int,
    n_workers: int,
    sized: Callable[[int], Schedule],
) -> str | Schedule | None:
    """``schedule``, or for ``"auto"`` the schedule built for ``memory_budget``; what the two
    wraps call before building the pipe.

    Args:
        schedule: wrap's ``schedule=``.
        memory_budget: wrap's ``memory_budget=`` (see :func:`for_budget`).
        n_stages: the stages given (None: the layout is to be searched).
        chunks: micro-batches (M).
        n_workers: devices or ranks of one pipeline.
        sized: the schedule for a budget in bytes (it profiles the model); called only for
            a size.

    Raises:
        ValueError: ``memory_budget`` without ``schedule="auto"``, ``"auto"`` without the
            stages, or a budget :func:`for_budget` refuses.
    """
    if schedule != AUTO:
        if memory_budget is not None:
            raise ValueError(
                f"memory_budget={memory_budget!r} bounds schedule='auto', but schedule="
                f"{schedule!r}; pass schedule='auto' (the fastest schedule within the budget)"
            )
        return schedule
    if n_stages is None:
        raise ValueError(
            "schedule='auto' builds the order for the stages; pass balance=[...] or "
            "split=[...] with it, or a sample for the layout search to choose them"
        )
    if isinstance(memory_budget, str) and not memory_budget.strip().endswith("%"):
        return sized(parse_bytes(memory_budget, name="memory_budget"))
    return for_budget(memory_budget, n_stages, chunks, n_workers=n_workers)


def refuse_searched(schedule: object, memory_budget: object) -> None:
    """``schedule="auto"`` with ``memory_budget`` where the layout is to be searched: a
    ValueError before the search (the search builds its order for the devices' capacity).

    Raises:
        ValueError: for ``"auto"`` with a budget.
    """
    if schedule == AUTO and memory_budget is not None:
        raise ValueError(
            f"memory_budget={memory_budget!r} bounds the order built for stages you give, but "
            "the layout is to be searched (no balance or split): the search builds "
            "schedule='auto' for what each device has left of capacity=...; pass "
            "balance=[...] or split=[...] with memory_budget, or capacity=... without it"
        )


def for_budget(
    memory_budget: float | str | None,
    n_stages: int,
    chunks: int,
    *,
    n_workers: int,
    activation: Sequence[float] | None = None,
) -> Schedule:
    """``wrap(schedule="auto", memory_budget=...)``'s schedule: the fastest within the budget,
    stages of equal cost (the balance evens them).

    Args:
        memory_budget: what a device may hold at once: a number, micro-batches of all its
            stages (1F1B's first device holds ``min(K, M)``); ``"50%"``, a share of 1F1B's; a
            size with a unit (``"2GiB"``), activation bytes (``activation`` needed); None:
            ``"100%"``.
        n_stages: stages of the balance.
        chunks: micro-batches (M).
        n_workers: devices or ranks of one pipeline.
        activation: per stage, the bytes one micro-batch's activations take.

    Raises:
        ValueError: a budget below any schedule's (naming the smallest), bytes without
            ``activation``, or text that is neither a share nor a size.

    Example:
        >>> for_budget("50%", 8, 8, n_workers=4).max_in_flight  # 2 of 1F1B's 4: 4 half stages
        (4, 4, 4, 4)
    """
    given, weight = _budget_and_weight(memory_budget, n_stages, chunks, n_workers, activation)
    least = least_budget(n_stages, n_workers, weight)
    if given < least * (1 - 1e-9):
        raise ValueError(
            f"memory_budget={memory_budget!r} is {_show(given)} "
            f"{'bytes' if weight else 'micro-batches'} per device, below what any schedule "
            f"holds on {n_stages} stages over {n_workers} devices: {_show(least)} (one "
            f"micro-batch on all of a device's stages); pass memory_budget >= "
            f"{_least_form(memory_budget, least, n_workers, chunks)}"
        )
    return budget_schedule(
        n_stages, chunks, n_workers=n_workers, budget=given, weight=weight, label="memory_budget"
    )


def _budget_and_weight(
    memory_budget: float | str | None,
    n: int,
    m: int,
    k: int,
    activation: Sequence[float] | None,
) -> tuple[float, Sequence[float] | None]:
    text = "100%" if memory_budget is None else memory_budget
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise TypeError(
            f"memory_budget must be a number, a share like '50%' or a size like '2GiB', got "
            f"{type(text).__name__} {text!r}"
        )
    if isinstance(text, (int, float)):
        if not text > 0:
            raise ValueError(f"memory_budget must be positive, got {text!r}; pass e.g. 2")
        return float(text), None
    if text.strip().endswith("%"):
        share = _share(text)
        return share / 100 * one_f_one_b_held(k, m), None
    size = parse_bytes(text, name="memory_budget")
    if activation is None:
        raise ValueError(
            f"memory_budget={text!r} is a size, but the stages' activation bytes are unknown; "
            "pass sample=<one step's batch> to profile them, or a number of micro-batches"
        )
    return float(size), activation


def _share(text: str) -> float:
    try:
        share = float(text.strip()[:-1])
    except ValueError:
        share = float("nan")
    if not share > 0:
        raise ValueError(f"memory_budget={text!r} is not a positive share; pass e.g. '50%'")
    return share


def _least_form(memory_budget: object, least: float, k: int, m: int) -> str:
    """The smallest budget in the form the caller gave it."""
    if isinstance(memory_budget, str) and memory_budget.strip().endswith("%"):
        return f"'{math.ceil(100 * least / one_f_one_b_held(k, m))}%'"
    if isinstance(memory_budget, str):
        return f"'{math.ceil(least)}' ({format_bytes(least)})"
    return _show(least)


def _show(x: float) -> str:
    return f"{x:g}"
