"""How a layer's time grows with its rows: a part each call costs, and a part per row.

A profile measures each layer once, on the whole sample batch. A pipeline runs it on
micro-batches, and a small micro-batch costs more than its share of rows: every call launches
its kernels and runs the framework's own code, a product of few rows does not fill the device,
and a weight gradient is written whole whatever the rows. Scaling the whole batch's time by
``rows / batch`` misses all that, so more micro-batches always look cheaper: on a 2-core CPU a
GPT-2 step with 16 micro-batches ran 1.5-2x the time so predicted.

Two profiles on different rows fix a line per layer and direction, ``t(r) = call + r * (t(B) -
call)`` for a share ``r`` of the batch's ``B`` rows; :func:`with_call_times` fits it and
stores ``call`` as :attr:`~pipepar.planner.profile.LayerProfile.forward_call_ms` and
``backward_call_ms`` of the whole-batch profile, which then predicts every micro-batch size
between the two (and, less surely, beyond). :func:`at_share` is the time of one call.

    >>> whole = pipepar.profile(model, x, device="cuda:0")
    >>> small = pipepar.profile(model, x[:4], device="cuda:0")
    >>> prof = with_call_times(whole, small)
    >>> prof.layers[0].forward_call_ms <= prof.layers[0].forward_ms
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from pipepar.batching.calls import as_call, split_call
from pipepar.batching.rules import Rules
from pipepar.planner.profile import LayerProfile, Profile

__all__ = [
    "at_share",
    "check_call_times",
    "profile_for_chunks",
    "profile_two_sizes",
    "smallest_micro_batch",
    "with_call_times",
]


def at_share(ms: float, call_ms: float, share: float) -> float:
    """The time of a call on ``share`` of the batch's rows, from the whole batch's ``ms`` of
    which ``call_ms`` each call costs.

    Example:
        >>> at_share(10.0, 2.0, 0.25)
        4.0
    """
    return call_ms + share * (ms - call_ms)


def with_call_times(profile: Profile, small: Profile) -> Profile:
    """``profile`` with each layer's time per call fitted against ``small``, a profile of the
    same model on fewer rows.

    Args:
        profile: a measured profile of ``B`` rows.
        small: a measured profile of the same layers on ``b < B`` rows.

    Returns:
        ``profile`` with :attr:`~LayerProfile.forward_call_ms` and
        :attr:`~LayerProfile.backward_call_ms` set: per layer, the time a call costs whatever
        its rows, between 0 and the smaller of the two measured times (the host's noise can
        make a small batch look slower than a large one; then all of it is per call).

    Raises:
        ValueError: either profile has no times, their layers differ, or ``small`` does not
            have fewer rows.

    Example:
        >>> fitted = with_call_times(whole, small)
        >>> at_rows(fitted, 4).layers[0].forward_ms  # about small.layers[0].forward_ms
    """
    _check_pair(profile, small)
    big_rows, small_rows = profile.batch_size, small.batch_size
    layers = [
        replace(
            layer,
            forward_call_ms=_call(layer.forward_ms, other.forward_ms, big_rows, small_rows),
            backward_call_ms=_call(layer.backward_ms, other.backward_ms, big_rows, small_rows),
        )
        for layer, other in zip(profile.layers, small.layers)
    ]
    return replace(profile, layers=layers)


def profile_two_sizes(profile_fn: Callable[[Any], Profile], sample: Any, chunks: int) -> Profile:
    """``profile_fn(sample)`` with call times fitted against ``profile_fn`` of the smallest of
    ``chunks`` micro-batches of ``sample``, the smallest a pipe with ``chunks`` micro-batches
    runs. A profile without times, or ``chunks`` of 1, is returned as measured.

    Raises:
        ValueError: the model runs on ``sample`` but fails on that micro-batch (e.g. a
            training-mode batch norm given one row): ``chunks`` is too many for the batch.

    Example:
        >>> prof = profile_two_sizes(lambda s: pipepar.profile(model, s, device="cpu"), x, 16)
    """
    return profile_for_chunks(profile_fn, sample, [chunks])[0]


def profile_for_chunks(
    profile_fn: Callable[[Any], Profile],
    sample: Any,
    chunks: Sequence[int],
    model: nn.Module | None = None,
    rules: Rules | None = None,
) -> tuple[Profile, list[int]]:
    """``profile_fn(sample)`` with call times fitted against the smallest micro-batch of the
    largest count in ``chunks`` whose micro-batches the model runs, and the counts of
    ``chunks`` it runs: the model is only ever given micro-batches a pipe of one of them runs,
    and a count whose micro-batches it fails on (a training-mode batch norm given one row) is
    left out of the search. Without times nothing but ``sample`` runs. ``model`` cuts the
    sample as its pipe would (the packed inputs of a multimodal model recognised).

    Raises:
        ValueError: ``chunks`` holds one count (the caller's) and the model fails on its
            micro-batches, though it runs on ``sample``: the message names both.

    Example:
        >>> prof, runs = profile_for_chunks(profile_fn, torch.randn(4, 3, 32, 32), [1, 2, 4])
        >>> runs  # a ResNet in training mode fails on one row
        [1, 2]
    """
    whole = profile_fn(sample)
    rows, counts = whole.batch_size, sorted(set(chunks), reverse=True)
    if not whole.timed or rows < 2 or counts[0] <= 1:
        return whole, list(chunks)
    failed: dict[int, Exception] = {}
    for count in counts:
        least = rows // min(count, rows)  # the last micro-batch is the smallest
        if least >= rows:
            break
        if least in failed:
            continue
        try:
            small = profile_fn(smallest_micro_batch(sample, count, model, rules))
        except Exception as error:  # any failure of the model on it
            failed[least] = error
            continue
        return with_call_times(whole, small), [c for c in chunks if rows // min(c, rows) >= least]
    if len(counts) == 1:
        raise _too_many(counts[0], rows, min(failed), failed[min(failed)])
    return whole, [c for c in chunks if min(c, rows) <= 1]


def _too_many(chunks: int, rows: int, least: int, error: Exception) -> ValueError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    most = max(1, rows // (least + 1))
    return ValueError(
        f"chunks={chunks} splits the batch of {rows} rows into micro-batches of as few as "
        f"{least} row(s), and the model fails on {least} row(s) though it runs on {rows} "
        f"({first}); pass chunks <= {most} or a larger batch"
    )


def smallest_micro_batch(
    sample: Any, chunks: int, model: nn.Module | None = None, rules: Rules | None = None
) -> Any:
    """The smallest (the last) of ``chunks`` micro-batches of ``sample``, in the sample's own
    form (a tensor, a tuple of positional arguments or a dict of keyword arguments), cut as
    a pipe of ``model`` with ``rules`` (``wrap``'s ``split_inputs``) cuts it
    (:func:`pipepar.batching.calls.split_call`).

    Example:
        >>> smallest_micro_batch(torch.zeros(10, 3), 4).shape
        torch.Size([2, 3])
    """
    args, kwargs = as_call(sample)
    part = split_call(args, kwargs, chunks, rules, model)[-1]
    if isinstance(sample, dict):
        return part.kwargs
    return part.args if isinstance(sample, tuple) else part.args[0]


def check_call_times(layer: LayerProfile, what: str) -> None:
    """A time per call lies between 0 and the time of the whole batch it is part of."""
    for name in ("forward", "backward"):
        call, whole = getattr(layer, f"{name}_call_ms"), getattr(layer, f"{name}_ms")
        if not (math.isfinite(call) and 0 <= call <= (whole if whole is not None else 0.0)):
            raise ValueError(
                f"{what} has {name}_call_ms={call!r} with {name}_ms={whole!r}, but the part "
                "each call costs must be finite, >= 0 and at most the whole time (0 without "
                "times); fit it with pipepar.planner.call_times.with_call_times"
            )


def _call(big: float | None, small: float | None, big_rows: int, small_rows: int) -> float:
    """The intercept of the line through (small_rows, small) and (big_rows, big), clipped."""
    assert big is not None and small is not None  # checked by _check_pair
    call = (small * big_rows - big * small_rows) / (big_rows - small_rows)
    return min(max(call, 0.0), big, small)


def _check_pair(profile: Profile, small: Profile) -> None:
    for name, prof in (("profile", profile), ("small", small)):
        if not prof.timed:
            raise ValueError(
                f"{name} (on {prof.device}) has no layer times; fit call times from two "
                "profiles measured on a real device, e.g. device='cuda:0' or 'cpu'"
            )
    if _names(profile.layers) != _names(small.layers):
        raise ValueError(
            f"profile has layers {_names(profile.layers)[:4]}... but small has "
            f"{_names(small.layers)[:4]}...; profile the same model on both batches"
        )
    if not small.batch_size < profile.batch_size:
        raise ValueError(
            f"small has {small.batch_size} rows and profile {profile.batch_size}; small must "
            "be a profile on fewer rows, e.g. one micro-batch of the sample"
        )


def _names(layers: list[LayerProfile]) -> list[tuple[str, str]]:
    return [(x.name, x.type_name) for x in layers]
