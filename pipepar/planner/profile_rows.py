"""A profile taken on one batch, scaled to a batch of another number of rows.

A :class:`~pipepar.planner.profile.Profile` describes one step on its sample batch, and
:func:`pipepar.plan` takes that batch as the mini-batch it splits into micro-batches. A layout
search tries several data-parallel degrees for one global batch, so each pipeline replica takes
a different number of rows; profiling the model again for each would cost as much as the search.
:func:`at_rows` scales instead: every figure that grows with the rows (activations, outputs,
temporaries, the gradients recorded for W, the saved inputs of direct products, storages)
by ``rows / batch_size``, and times the same beyond the part each call costs whatever its
rows (:mod:`pipepar.planner.call_times`; none unless fitted); parameters, their gradients,
optimizer state and the optimizer step's temporaries stay.

That is exact for layers whose work and activations are proportional to the rows (linear
layers, convolutions, attention over a fixed sequence length) and a small error for tensors
the forward makes whatever the batch (a rotary table, a causal mask): those scale too. For
exact figures at one number of rows, profile the model on a sample of that many rows.

This module only rescales data; it imports the profile's types and nothing that plans.

    >>> prof = pipepar.profile(model, torch.randn(8, 1024))
    >>> at_rows(prof, 32).layers[0].activation_bytes == 4 * prof.layers[0].activation_bytes
    True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipepar.planner.call_times import at_share
from pipepar.planner.profile import LayerProfile, Profile

__all__ = ["at_rows"]

_ROW_BYTES = (
    "activation_bytes",
    "output_bytes",
    "forward_peak_bytes",
    "backward_peak_bytes",
    "backward_inner_bytes",
    "deferred_grad_bytes",
    "direct_saved_bytes",
    "direct_saved_input_bytes",
    "split_input_peak_bytes",
)
"""LayerProfile fields that are bytes for the whole batch and grow with its rows."""


def at_rows(profile: Profile, rows: int) -> Profile:
    """``profile`` as if taken on a batch of ``rows`` rows (the same rows, repeated or cut).

    Args:
        profile: a profile of ``profile.batch_size`` rows.
        rows: the rows of the batch to describe.

    Returns:
        The scaled profile; ``profile`` itself when ``rows`` is its batch size.

    Raises:
        ValueError: ``rows`` is not a positive int, or the profile has no rows to scale from.

    Example:
        >>> at_rows(prof, 2 * prof.batch_size).batch_size == 2 * prof.batch_size
        True
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be an int >= 1 (rows of the batch)")
    if profile.batch_size < 1:
        raise ValueError(
            f"the profile's batch has {profile.batch_size} rows, nothing to scale from; profile "
            "on a sample with the batch on dimension 0"
        )
    if rows == profile.batch_size:
        return profile
    r = rows / profile.batch_size
    return replace(
        profile,
        layers=[_layer(layer, r, profile.batch_size, rows) for layer in profile.layers],
        batch_size=rows,
        input_shape=_shape(profile.input_shape, profile.batch_size, rows),
        input_bytes=round(r * profile.input_bytes),
        storages=[replace(s, nbytes=round(r * s.nbytes)) for s in profile.storages],
    )


def _layer(layer: LayerProfile, r: float, old: int, new: int) -> LayerProfile:
    changes: dict[str, Any] = {name: round(r * getattr(layer, name)) for name in _ROW_BYTES}
    for name in ("forward", "backward"):
        value, call = getattr(layer, f"{name}_ms"), getattr(layer, f"{name}_call_ms")
        changes[f"{name}_ms"] = None if value is None else at_share(value, call, r)
    # A backward's points pair (bytes that scale, parameter-gradient bytes that do not).
    for name in ("backward_points", "retained_points"):
        changes[name] = tuple((round(r * other), grads) for other, grads in getattr(layer, name))
    changes["output_shape"] = _shape(layer.output_shape, old, new)
    return replace(layer, **changes)


def _shape(shape: Any, old: int, new: int) -> Any:
    """A shape (or nested shapes) with a leading ``old`` rows made ``new``."""
    if not isinstance(shape, tuple) or not shape:
        return shape
    if all(isinstance(d, int) for d in shape):
        return (new, *shape[1:]) if shape[0] == old else shape
    return tuple(_shape(s, old, new) for s in shape)
