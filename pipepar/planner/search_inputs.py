"""What a layout search starts from, checked: the profile, the FLOPs that time it, the cluster.

:func:`~pipepar.planner.layout_search.search_layouts` takes a model or a profile, and times
from a measured profile or from FLOP counts; a named cluster gets as many nodes as the devices
need. Every check here raises at once with the value given and how to fix it.

    >>> prof, flops, chunks = search_profile(model, sample, optimizer="adam", device="meta",
    ...                                      flops=None, chunks=[1, 2, 4])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from pipepar.batching.rules import Rules
from pipepar.planner.call_times import profile_for_chunks
from pipepar.planner.cluster import Cluster
from pipepar.planner.model_profile import profile
from pipepar.planner.plan_inputs import check_profile
from pipepar.planner.profile import Profile
from pipepar.planner.step_time import Flops

__all__ = [
    "check_choices",
    "check_count",
    "check_counts",
    "check_offloads",
    "check_shards",
    "search_cluster",
    "search_profile",
]


def search_profile(
    model_or_profile: object,
    sample: object,
    *,
    optimizer: object,
    device: str,
    flops: object,
    chunks: Sequence[int] = (1,),
    rules: Rules | None = None,
) -> tuple[Profile, Flops | None, list[int]]:
    """The checked profile, the FLOPs to time it by (None: it has measured times), and the
    counts of ``chunks`` to search.

    A model is profiled on ``device`` (an ``nn.Sequential`` by its layers, any other module
    by its units) and, without times, its FLOPs are counted on ``meta``. With times, it is
    profiled again on the smallest micro-batch of the most ``chunks`` it runs (the smallest
    the search tries) to tell each layer's time per call from its time per row; counts whose
    micro-batches the model fails on are left out, and one count given that it fails on is a
    ValueError (:func:`~pipepar.planner.call_times.profile_for_chunks`).
    """
    counts = list(chunks)
    if isinstance(model_or_profile, Profile):
        prof = model_or_profile.with_optimizer(optimizer)
    elif isinstance(model_or_profile, nn.Module):
        if sample is None:
            raise ValueError(
                "search_layouts was given a model but no sample; pass sample=<an input batch> "
                "or a Profile from pipepar.profile"
            )
        prof, counts = profile_for_chunks(
            functools.partial(profile, model_or_profile, device=device, optimizer=optimizer),
            sample,
            counts,
            model_or_profile,
            rules,
        )
        if not prof.timed and flops is None:
            # imported here: torch's flop counter loads triton (~0.3 s), which every rank's
            # `import pipepar.distributed` paid for a search most processes never run
            from pipepar.planner.flop_count import count_flops

            flops = count_flops(model_or_profile, sample, prof)
    else:
        raise TypeError(
            "search_layouts needs a model or a pipepar Profile, got "
            f"{type(model_or_profile).__name__}; pass e.g. pipepar.profile(model, sample)"
        )
    check_profile(prof)
    if flops is not None:
        return prof, _check_flops(flops, len(prof)), counts
    if not prof.timed:
        raise ValueError(
            f"the profile (on {prof.device}) has no layer times; pass flops=count_flops(model, "
            "sample, profile), the model and sample instead of the profile, or a profile "
            "measured on a device"
        )
    return prof, None, counts


def _check_flops(flops: Any, n: int) -> list[tuple[float, float]]:
    pairs = [tuple(pair) for pair in flops]
    if len(pairs) != n:
        raise ValueError(
            f"flops has {len(pairs)} entries but the profile has {n} layers; pass one "
            "(forward, backward) pair per layer, e.g. count_flops(model, sample, profile)"
        )
    for i, pair in enumerate(pairs):
        numbers = len(pair) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair
        )
        if not numbers or not all(math.isfinite(x) and x >= 0 for x in pair):
            raise ValueError(
                f"flops[{i}] is {pair!r}; each entry must be two finite FLOP counts >= 0 "
                "(forward, backward)"
            )
    return [(float(f), float(b)) for f, b in pairs]


def search_cluster(cluster: object, devices: int) -> Cluster:
    """The cluster: a preset by name with as many nodes as ``devices`` needs, or one given,
    which must have that many devices."""
    if isinstance(cluster, str):
        per_node = Cluster.named(cluster).devices_per_node
        return Cluster.named(cluster, nodes=-(-devices // per_node))
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"cluster must be a Cluster or a preset name, got {type(cluster).__name__}; pass "
            "e.g. cluster='h100x8'"
        )
    if cluster.devices < devices:
        nodes = -(-devices // cluster.devices_per_node)
        raise ValueError(
            f"devices={devices} but cluster {cluster.name!r} has {cluster.devices}; pass "
            f"dataclasses.replace(cluster, nodes={nodes})"
        )
    return cluster


def check_count(name: str, value: object, example: str) -> int:
    """``value`` as an int >= 1, or a ValueError naming ``name`` and ``example``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}; {example}")
    return value


def check_counts(name: str, values: object) -> list[int]:
    """A non-empty sequence of ints >= 1."""
    if isinstance(values, (str, int)) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list of ints, got {values!r}; e.g. [8, 16]")
    return [check_count(f"{name}[{i}]", v, "e.g. 8") for i, v in enumerate(values)]


def check_choices(name: str, values: object, known: Sequence[str]) -> list[str]:
    """A non-empty sequence of names from ``known``, without repeats."""
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list of names, e.g. {list(known)}")
    for v in values:
        if v not in known:
            raise ValueError(f"{name} has {v!r}, not one of {list(known)}; pick from those")
    return list(dict.fromkeys(values))


def check_shards(values: object) -> list[bool]:
    """A non-empty sequence of ``False`` (replicated) and ``True`` (sharded), without repeats.

    Example:
        >>> check_shards((False, True))
        [False, True]
    """
    return _check_bools(
        "shards", values, "(False, True) to try replicated and sharded data parallelism, "
        "(False,) for replicated only", "True (sharded) or False (replicated)",
    )  # fmt: skip


def check_offloads(values: object, cluster: Cluster) -> list[bool]:
    """A non-empty sequence of ``False`` (no activation offload) and ``True`` (offload),
    without repeats, ``False`` first (the search tries offload where that does not fit).

    ``None`` is the search's own choice: offload is tried only where the devices have memory
    of their own (``cluster.host`` is a link, as on a GPU). Where the devices' memory is the
    host's (``host=None``, the CPU), offload moves saved tensors out of torch's allocator but
    not out of the machine, so a layout fitting only with it would fit on paper alone: the
    search does not try it unless asked for (``(True,)`` or ``(False, True)`` given).

    Example:
        >>> check_offloads((True, False), Cluster.named("cpu"))
        [False, True]
        >>> [check_offloads(None, Cluster.named(name)) for name in ("cpu", "h100x8")]
        [[False], [False, True]]
    """
    if values is None:
        return [False] if cluster.host is None else [False, True]
    example = "(False, True) to try offload where a layout does not fit without it"
    return sorted(_check_bools("offloads", values, example, "True (offload) or False (none)"))


def _check_bools(name: str, values: object, example: str, meaning: str) -> list[bool]:
    if isinstance(values, (str, bool)) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list of bools, got {values!r}; e.g. {example}")
    for i, v in enumerate(values):
        if not isinstance(v, bool):
            raise TypeError(f"{name}[{i}] is {v!r}, not a bool; pass {meaning}")
    return list(dict.fromkeys(values))
