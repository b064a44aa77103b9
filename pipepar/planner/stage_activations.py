"""What one micro-batch of each stage holds from its forward to its last backward action, in
bytes: the weights that turn ``memory_budget="2GiB"`` (``schedule="auto"``) into a bound on the
micro-batches in flight (:mod:`pipepar.core.memory_budget`), and the schedule for such a budget
checked against the planner's walk of each device's actions.

Weights alone miss what comes on top at a device's peak (the gradients a backward makes, the
incoming gradient, a forward's work space), so :func:`bytes_schedule` predicts each
candidate's activation peak (:class:`~pipepar.planner.stage_memory.MemoryModel`: the device's
peak less its parameters, gradients and optimizer state) and, while it exceeds the budget,
searches again under a budget for the weights lowered by the excess.

The figures are the planner's own (:class:`~pipepar.planner.stage_memory.MemoryModel` over a
profile on ``meta``, nothing allocated): a micro-batch kept with its graph (``checkpoint=
"never"``), or only its input when every micro-batch recomputes (``"always"``). Under
``"except_last"`` the last micro-batch is kept whole: a stage is weighed whole, which bounds it
from above. Stage 0's input is the batch itself, resident for the whole step and counted by no
schedule; the weight is never below one byte, so every stage counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipepar.core.named_schedules import gpipe
from pipepar.core.schedule import Schedule
from pipepar.core.schedule_budget import budget_schedule, least_budget
from pipepar.core.units import format_bytes
from pipepar.planner.model_profile import profile
from pipepar.planner.profile import Profile
from pipepar.planner.stage_memory import MemoryModel

__all__ = [
    "activation_bytes",
    "bytes_schedule",
    "predicted_activations",
    "stage_ranges",
    "stage_weights",
]


def activation_bytes(
    model: nn.Module,
    sample: Any,
    balance: Sequence[int] | None,
    chunks: int | None,
    checkpoint: str | None,
    *,
    chain: bool = True,
) -> list[float]:
    """Per stage of ``balance`` (layers or units), one micro-batch's activation bytes.

    Args:
        model: the model, not modified (profiled on ``meta``).
        sample: one step's batch.
        balance: layers (units) per stage.
        chunks: micro-batches (M); the sample's rows are cut into that many (None: 1).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``; None: the pipe's default
            (``"except_last"`` for a chain of layers, else ``"never"``).
        chain: whether the pipe runs ``model`` as a chain of layers.

    Raises:
        ValueError: ``sample`` or ``balance`` is None, or ``balance`` does not sum to the
            profiled layers.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        >>> len(activation_bytes(model, torch.randn(4, 8), [2, 2], 2, "never"))
        2
    """
    prof, mode = _profiled(model, sample, balance, checkpoint, chain)
    return stage_weights(prof, list(balance or ()), 1 if chunks is None else chunks, mode)


def bytes_schedule(
    model: nn.Module,
    sample: Any,
    balance: Sequence[int] | None,
    chunks: int | None,
    checkpoint: str | None,
    *,
    budget: int,
    n_workers: int,
    chain: bool = True,
) -> Schedule:
    """The fastest schedule found whose predicted activation peak on every device is at most
    ``budget`` bytes (arguments as :func:`activation_bytes`).

    Raises:
        ValueError: no schedule's predicted peak fits (naming the least one found).

    Example:
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        >>> bytes_schedule(model, torch.randn(4, 8), [1, 1, 1, 1], 2, "never", budget=10**6,
        ...                n_workers=2).name
        'auto'
    """
    prof, mode = _profiled(model, sample, balance, checkpoint, chain)
    stages, m = list(balance or ()), 1 if chunks is None else chunks
    weights = stage_weights(prof, stages, m, mode)
    least = least_budget(len(stages), n_workers, weights)
    level, least_peak = float(budget), None
    while True:
        s = budget_schedule(len(stages), m, n_workers=n_workers, budget=max(level, least),
                            weight=weights, label="memory_budget")  # fmt: skip
        peak = max(predicted_activations(prof, s, stages, mode))
        if peak <= budget:
            return s
        least_peak = peak if least_peak is None else min(least_peak, peak)
        if level <= least:
            raise ValueError(
                f"memory_budget={budget} bytes ({format_bytes(budget)}) is below the "
                f"activation peak any schedule found reaches on some device: {least_peak} "
                f"({format_bytes(least_peak)}, one micro-batch on all of a device's stages); "
                f"pass memory_budget >= '{least_peak}', or checkpoint='always'"
            )
        level = min(0.97 * level, level * budget / peak)


def predicted_activations(
    prof: Profile, schedule: Schedule, balance: Sequence[int], checkpoint: str
) -> list[int]:
    """Per device, the planner's peak less its parameters, gradients and optimizer state."""
    memory = MemoryModel(prof, schedule, checkpoint=checkpoint,
                         foreach=[False] * schedule.n_workers)  # fmt: skip
    ranges = stage_ranges(balance)
    out = []
    for w in range(schedule.n_workers):
        mine = [ranges[s] for s in schedule.stages_of(w)]
        static = sum(memory.static_bytes(a, b) for a, b in mine)
        out.append(sum(p.peak_bytes for p in memory.device(w, mine)) - static)
    return out


def _profiled(
    model: nn.Module,
    sample: Any,
    balance: Sequence[int] | None,
    checkpoint: str | None,
    chain: bool,
) -> tuple[Profile, str]:
    if balance is None:
        raise ValueError(
            "memory_budget is a size, which needs the stages as balance=[units per stage] "
            "(pipepar.units(model) lists them); or give it as micro-batches or a share ('50%')"
        )
    if sample is None:
        raise ValueError(
            "memory_budget is a size, but no sample was given to profile the stages' "
            "activations; pass sample=<one step's batch>, or memory_budget as a number of "
            "micro-batches or a share like '50%'"
        )
    prof = profile(model, sample, device="meta", optimizer=None)
    if sum(balance) != len(prof.layers):
        raise ValueError(
            f"balance sums to {sum(balance)} but the profile has {len(prof.layers)} layers "
            "(units); pass a balance over pipepar.units(model)"
        )
    return prof, checkpoint or ("except_last" if chain else "never")


def stage_weights(prof: Profile, balance: list[int], m: int, mode: str) -> list[float]:
    """Per stage of ``balance``, what one of its ``m`` micro-batches holds under recompute
    ``mode`` (its whole activations, or its input under ``"always"``), at least one byte."""
    n = len(balance)
    memory = MemoryModel(prof, gpipe(n, m), checkpoint=mode, foreach=[False] * n)
    out = []
    for a, b in stage_ranges(balance):
        figures = memory.figures(a, b)
        held = figures.inputs if mode == "always" else figures.whole
        out.append(float(max(1, held)))
    return out


def stage_ranges(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Per stage of ``balance``, its first and last layer."""
    out, a = [], 0
    for size in balance:
        out.append((a, a + size - 1))
        a += size
    return out
