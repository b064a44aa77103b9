"""What :func:`pipepar.plan` checks before it plans: its choices, the profile (built or
edited by hand, it may hold figures that would mislead the search), where stages may start,
and the model or profile it was given.

    >>> check_profile(pipepar.profile(model, sample))
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipepar.planner.call_times import check_call_times
from pipepar.planner.profile import Profile, profile

__all__ = ["as_profile", "check_choice", "check_chunks", "check_cut_points", "check_profile"]


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``, else a ValueError naming ``name``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}; pick one of those")


def check_chunks(chunks: object) -> int:
    """``chunks`` as an int >= 1, else the error naming it."""
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be an int (micro-batches), got {type(chunks).__name__}")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be >= 1; use e.g. chunks=8 micro-batches")
    return chunks


_BYTE_FIELDS = (
    "deferred_grad_bytes",
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "output_bytes",
    "forward_peak_bytes",
    "backward_peak_bytes",
)


def check_profile(prof: Profile) -> None:
    """A profile built or edited by hand: NaN or negative figures would mislead the search."""
    if not prof.layers:
        raise ValueError("the profile has no layers; profile a non-empty nn.Sequential")
    for layer in prof.layers:
        what = f"layer {layer.index} ({layer.type_name})"
        for name in ("forward_ms", "backward_ms"):
            value = getattr(layer, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"{what} has {name}={value!r}, but times must be finite and >= 0 (None when "
                    "not measured); re-profile on a real device or set it to None"
                )
        check_call_times(layer, what)
        for name in _BYTE_FIELDS:
            if getattr(layer, name) < 0:
                raise ValueError(
                    f"{what} has {name}={getattr(layer, name)!r}, but sizes must be >= 0; "
                    "re-profile the model with pipepar.profile"
                )


def check_cut_points(startable: list[bool], k: int, prof: Profile) -> None:
    """``k`` stages can start somewhere: enough layers that do not write into their input."""
    if sum(startable) >= k:
        return
    inplace = [i for i, ok in enumerate(startable) if not ok]
    raise ValueError(
        f"{k} stages need {k} places to start a stage, but only {sum(startable)} layers can "
        f"start one: layers {inplace} write into their input in place (e.g. ReLU(inplace=True)), "
        f"which a stage's first layer must not; use at most {sum(startable)} devices or make "
        "those layers out of place"
    )


def as_profile(
    model_or_profile: object, sample: object, optimizer: object, device: str | torch.device
) -> Profile:
    """The profile :func:`pipepar.plan` plans: the one given (its optimizer state counted
    again for ``optimizer``), or the ``nn.Sequential`` profiled on ``device``."""
    if isinstance(model_or_profile, Profile):
        return model_or_profile.with_optimizer(optimizer)
    if isinstance(model_or_profile, nn.Module):
        if sample is None:
            raise ValueError(
                "plan was given a model but no sample; pass sample=<an input batch> (any device, "
                "it is copied to meta) or a Profile from pipepar.profile"
            )
        return profile(model_or_profile, sample, device=device, optimizer=optimizer)  # type: ignore[arg-type]
    raise TypeError(
        f"plan needs an nn.Sequential or a pipepar Profile, got {type(model_or_profile).__name__}"
    )
