"""What a runtime adds to the profile's layer times on the machine at hand, fitted to steps
measured there.

A profile times each layer alone, on an idle machine, once per batch. A pipe's actions cost more:
its workers share cores, caches and (in one process) an interpreter; each action has the
runtime's own work (a hand-over, the gradient hooks, the sum of a parameter's gradient over
micro-batches); a recompute runs under checkpointing's bookkeeping. None of that is in a
layer's time, and how much it is depends on the machine, the runtime (threads of one process,
or ranks) and the model. :class:`RuntimeFit` holds six numbers for it, which
:func:`~pipepar.planner.step_time.predict_step` applies to every action it simulates:

- ``scale``: every F, B, W and recompute takes ``scale`` x its profiled time;
- ``action_ms``: every F and B takes ``action_ms`` more (the runtime's work per action: the
  hand-over, the cut's hooks; a W, deferred work of the same stage, has none of it);
- ``layer_ms``: every F and B takes ``layer_ms`` more per layer (unit) of its stage (the work
  that grows with the layers an action runs: per-unit hooks, and in one process the model's
  Python waiting for the interpreter that the other workers hold);
- ``recompute_scale``: a recompute takes ``recompute_scale`` x the forward it repeats;
- ``recompute_ms``: every recompute takes ``recompute_ms`` more per layer it runs again
  (restoring the random state, re-entering each unit's forward: a cost per call, which the
  many small calls of a large micro-batch count pay many times);
- ``handover_ms``: every hand-over between two workers takes ``handover_ms`` more than the
  link's figures (the receiver waking, a busy interpreter, a rank's messaging).

:func:`pipepar.planner.calibrate.fit_runtime` finds them from a few layouts' measured step
times on the machine and runtime at hand.

    >>> fit = RuntimeFit(scale=1.15, action_ms=0.4, recompute_scale=1.5)
    >>> predict_step(prof, [4, 4], cluster=local, schedule="zb-h1", chunks=8, runtime=fit)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RuntimeFit", "check_runtime"]

BOUNDS = {
    "scale": (0.25, 8.0),
    "action_ms": (0.0, 1e4),
    "handover_ms": (0.0, 1e4),
    "recompute_scale": (0.25, 8.0),
    "layer_ms": (0.0, 1e4),
    "recompute_ms": (0.0, 1e4),
}


@dataclass(frozen=True)
class RuntimeFit:
    """How one runtime's actions compare with the profile's layer times (see the module).

    Example:
        >>> fit = RuntimeFit(scale=1.2, action_ms=0.5)
        >>> fit.action(10.0), fit.action(0.0), fit.weight(10.0), fit.recompute(10.0)
        (12.5, 0.5, 12.0, 12.0)
    """

    scale: float = 1.0
    """Every F, B, W and recompute takes this many times its profiled time."""
    action_ms: float = 0.0
    """Milliseconds the runtime adds to every F and B action."""
    recompute_scale: float = 1.0
    """A recompute against the forward it repeats (on top of ``scale``)."""
    handover_ms: float = 0.0
    """Milliseconds the runtime adds to every hand-over between two workers (waking the
    receiver, on top of the link's latency and bytes)."""
    layer_ms: float = 0.0
    """Milliseconds the runtime adds to every F and B action per layer of its stage."""
    recompute_ms: float = 0.0
    """Milliseconds the runtime adds to every recompute, per layer it runs again."""
    fitted_to: int = 0
    """How many measured steps the values were fitted to (0: the identity, nothing fitted)."""
    worst_error: float = 0.0
    """The largest |predicted - measured| / measured over those steps."""

    def __post_init__(self) -> None:
        for name, (low, high) in BOUNDS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and low <= value <= high):
                raise ValueError(
                    f"RuntimeFit.{name} must be a number in [{low}, {high}], got {value!r}; "
                    "fit it with fit_runtime, or leave it at its default"
                )

    def action(self, ms: float, layers: int = 0) -> float:
        """An F or B action of a stage of ``layers`` layers that the profile times at ``ms``."""
        return self.scale * ms + self.action_ms + self.layer_ms * layers

    def weight(self, ms: float) -> float:
        """A W action that the profile times at ``ms``."""
        return self.scale * ms

    def recompute(self, ms: float, layers: int = 0) -> float:
        """The recompute of a forward of ``layers`` layers that the profile times at ``ms``."""
        return self.scale * self.recompute_scale * ms + self.recompute_ms * layers

    def to_dict(self) -> dict[str, float]:
        """The values as plain numbers (to write as JSON beside measurements)."""
        return {
            "scale": self.scale,
            "action_ms": self.action_ms,
            "recompute_scale": self.recompute_scale,
            "handover_ms": self.handover_ms,
            "layer_ms": self.layer_ms,
            "recompute_ms": self.recompute_ms,
            "fitted_to": self.fitted_to,
            "worst_error": self.worst_error,
        }


def check_runtime(runtime: object) -> RuntimeFit | None:
    """``runtime`` if it is a :class:`RuntimeFit` or None; else the TypeError with the fix."""
    if runtime is not None and not isinstance(runtime, RuntimeFit):
        raise TypeError(
            f"runtime must be a RuntimeFit or None, got {type(runtime).__name__}; fit one with "
            "pipepar.planner.fit_runtime(profile, measured, cluster=...)"
        )
    return runtime
