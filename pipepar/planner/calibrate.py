"""Fitting a :class:`~pipepar.planner.runtime_fit.RuntimeFit` to steps measured on the machine
at hand: the values whose predictions are nearest the measurements.

Fit on layouts that differ in micro-batch count (which separates the time per action from the
scale), in recompute (which sets the recompute's scale) and, for the hand-over time, in
schedule; then predict the others, or search with the fit (``search_layouts(...,
runtime=fit)``).

    >>> fit = fit_runtime(prof, [
    ...     Measured([4, 4], "1f1b", 4, "never", 118.3),
    ...     Measured([4, 4], "1f1b", 16, "never", 204.9),
    ...     Measured([4, 4], "1f1b", 8, "except_last", 174.4),
    ... ], cluster=measure_local())
    >>> predict_step(prof, [4, 4], cluster=local, schedule="zb-h1", chunks=8, runtime=fit)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pipepar.planner.cluster import Cluster
from pipepar.planner.profile import Profile
from pipepar.planner.runtime_fit import BOUNDS, RuntimeFit
from pipepar.planner.step_time import predicted_step_ms

__all__ = ["Measured", "fit_runtime"]


@dataclass(frozen=True)
class Measured:
    """One layout's measured step: what ``predict_step`` takes to predict it, and the time.

    Example:
        >>> Measured([4, 4], "1f1b", 8, "never", 131.5).step_ms
        131.5
    """

    balance: Sequence[int]
    """Layers per stage, as ``predict_step`` takes them."""
    schedule: str
    chunks: int
    checkpoint: str
    step_ms: float
    """The measured step (median over steps), in milliseconds."""
    options: dict[str, object] = field(default_factory=dict)
    """Further ``predict_step`` keywords (``dp``, ``dp_shard``, ``weight_share``)."""


Predictor = Callable[[Measured, RuntimeFit], float]
"""``predictor(layout, fit)``: the layout's predicted step (ms) under ``fit``."""


def fit_runtime(
    profile: Profile,
    measured: Sequence[Measured],
    *,
    cluster: Cluster | str,
    predictor: Predictor | None = None,
    fitted: Sequence[str] | None = None,
) -> RuntimeFit:
    """The :class:`RuntimeFit` whose predictions are nearest ``measured`` (least squares of
    ``log(predicted / measured)``), searched within its bounds.

    Args:
        profile: the profile the predictions read (a measured one).
        measured: the layouts run on this machine and runtime, with their step times. Two or
            more with different ``chunks`` fit ``scale`` and ``action_ms``; ``handover_ms``
            stays 0 unless two with as many stages also differ in schedule,
            ``recompute_scale`` 1 unless one of them recomputes (``checkpoint`` not
            ``"never"``), ``recompute_ms`` 0 unless two recomputing ones differ in
            ``chunks``, ``layer_ms`` 0 unless they differ in the number of stages (e.g.
            1f1b and interleaved-1f1b on the same devices).
        cluster: as ``predict_step`` takes it (e.g. ``measure_local()``).
        predictor: how a layout is predicted (default: ``predict_step(profile, ...).step_ms``).
        fitted: the names of the values to fit (e.g. ``["scale", "action_ms"]``); the rest
            keep their defaults. Default: those the layouts can separate (above).

    Returns:
        The fitted :class:`RuntimeFit` (``fitted_to``: how many layouts, ``worst_error``: the
        largest relative error left among them), to pass as ``runtime=`` to
        ``predict_step``, ``search_layouts`` or ``wrap(sample=...)``.

    Raises:
        ValueError: no measured layout, a step time not > 0, or an unknown name in
            ``fitted``.

    Example:
        >>> fit = fit_runtime(prof, runs, cluster=measure_local())
        >>> fit.scale, fit.action_ms, fit.recompute_scale
    """
    runs = _checked(measured)
    predict = predictor or _step_predictor(profile, cluster)
    free = _checked_names(fitted) if fitted is not None else _separable(runs)

    def loss(fit: RuntimeFit) -> float:
        return sum(math.log(predict(r, fit) / r.step_ms) ** 2 for r in runs)

    per_action = max(0.05, 0.02 * min(r.step_ms / max(1, r.chunks) for r in runs))
    steps = {"scale": 0.25, "recompute_scale": 0.25, "action_ms": per_action}
    steps |= {"handover_ms": per_action, "recompute_ms": per_action, "layer_ms": per_action / 4}
    best = _pattern_search(RuntimeFit(), loss, {name: steps[name] for name in free})
    worst = max(abs(predict(r, best) / r.step_ms - 1.0) for r in runs)
    return replace(best, fitted_to=len(runs), worst_error=worst)


def _checked_names(fitted: Sequence[str]) -> list[str]:
    names = list(fitted)
    unknown = [n for n in names if n not in BOUNDS]
    if unknown or isinstance(fitted, str):
        raise ValueError(
            f"fitted={fitted!r} names no RuntimeFit value {unknown or [fitted]}; pass a list of "
            f"{sorted(BOUNDS)}"
        )
    return names


def _separable(runs: Sequence[Measured]) -> list[str]:
    """The values the layouts can tell apart (see :func:`fit_runtime`)."""
    free = ["scale"]
    stages = {len(r.balance) for r in runs}
    if len({r.chunks for r in runs}) > 1:
        free.append("action_ms")
        if any(len({r.schedule for r in runs if len(r.balance) == n}) > 1 for n in stages):
            free.append("handover_ms")
    recomputing = [r for r in runs if r.checkpoint != "never"]
    if recomputing:
        free.append("recompute_scale")
        if len({r.chunks for r in recomputing}) > 1:
            free.append("recompute_ms")
    if len(stages) > 1:
        free.append("layer_ms")
    return free


def _pattern_search(
    start: RuntimeFit, loss: Callable[[RuntimeFit], float], steps: dict[str, float]
) -> RuntimeFit:
    """Move one value at a time by its step while the loss falls; halve the steps when no
    move helps, until they are 1/1000 of where they began."""
    best, best_loss = start, loss(start)
    smallest = {name: step / 1000 for name, step in steps.items()}
    while any(steps[name] > smallest[name] for name in steps):
        moved = False
        for name in steps:
            for sign in (1.0, -1.0):
                trial = _moved(best, name, sign * steps[name])
                if trial is None:
                    continue
                value = loss(trial)
                if value < best_loss - 1e-12:
                    best, best_loss, moved = trial, value, True
                    break
        if not moved:
            steps = {name: step / 2 for name, step in steps.items()}
    return best


def _moved(fit: RuntimeFit, name: str, by: float) -> RuntimeFit | None:
    low, high = BOUNDS[name]
    value = getattr(fit, name) + by
    return replace(fit, **{name: value}) if low <= value <= high else None


def _step_predictor(profile: Profile, cluster: Cluster | str) -> Predictor:
    def predict(run: Measured, fit: RuntimeFit) -> float:
        return predicted_step_ms(
            profile,
            run.balance,
            cluster=cluster,
            schedule=run.schedule,
            chunks=run.chunks,
            checkpoint=run.checkpoint,
            runtime=fit,
            **run.options,
        )

    return predict


def _checked(measured: Sequence[Measured]) -> list[Measured]:
    runs = list(measured)
    if not runs:
        raise ValueError(
            "measured is empty; pass the step times of two or more layouts run on this "
            "machine, e.g. [Measured([4, 4], '1f1b', 4, 'never', 118.3), ...]"
        )
    for k, run in enumerate(runs):
        if not isinstance(run, Measured):
            raise TypeError(
                f"measured[{k}] is a {type(run).__name__}; pass Measured(balance, schedule, "
                "chunks, checkpoint, step_ms)"
            )
        if not (math.isfinite(run.step_ms) and run.step_ms > 0):
            raise ValueError(
                f"measured[{k}].step_ms is {run.step_ms!r}; pass the measured step in "
                "milliseconds (> 0)"
            )
    return runs
