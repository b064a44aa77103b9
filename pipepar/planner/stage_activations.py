"""What one micro-batch of each stage holds from its forward to its last backward action, in
bytes: the weights that turn ``memory_budget="2GiB"`` (``schedule="auto"``) into a bound on the
micro-batches in flight (:mod:`pipepar.core.memory_budget`).

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
from pipepar.planner.model_profile import profile
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["activation_bytes"]


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
    if sample is None:
        raise ValueError(
            "memory_budget is a size, but no sample was given to profile the stages' "
            "activations; pass sample=<one step's batch>, or memory_budget as a number of "
            "micro-batches or a share like '50%'"
        )
    if balance is None:
        raise ValueError(
            "memory_budget is a size, which needs the stages as balance=[units per stage] "
            "(pipepar.units(model) lists them); or give it as micro-batches or a share ('50%')"
        )
    mode = checkpoint or ("except_last" if chain else "never")
    m = 1 if chunks is None else chunks
    prof = profile(model, sample, device="meta", optimizer=None)
    n_layers = len(prof.layers)
    if sum(balance) != n_layers:
        raise ValueError(
            f"balance sums to {sum(balance)} but the profile has {n_layers} layers (units); "
            "pass a balance over pipepar.units(model)"
        )
    n = len(balance)
    memory = MemoryModel(prof, gpipe(n, m), checkpoint=mode, foreach=[False] * n)
    out, a = [], 0
    for size in balance:
        figures = memory.figures(a, a + size - 1)
        held = figures.inputs if mode == "always" else figures.whole
        out.append(float(max(1, held)))
        a += size
    return out
