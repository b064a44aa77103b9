"""Choose the layout of a pipe being wrapped: what the user gave is fixed, the rest is chosen.

``pipepar.wrap(model, sample=x, devices=N)`` and ``pipepar.distributed.wrap(model, plan="auto",
sample=x)`` leave the balance, and whichever of the schedule, micro-batches, recompute and
data-parallel degree the user did not pass, to :func:`~pipepar.planner.layout_search.
search_layouts`: each value given restricts the search to it (:class:`Given`), and the
fastest layout that fits is the pipe's. The cluster is the machine the devices are on
(:func:`~pipepar.planner.cluster.cluster_for`), and each device holds what
:func:`~pipepar.planner.cluster.device_memory` says unless a capacity is given.

    >>> layout = choose_layout(model, torch.randn(32, 64), devices=2, given=Given(dp=1),
    ...                        cluster=cluster_for(torch.device("cpu"), 2),
    ...                        capacity=device_memory(torch.device("cpu"), 2))
    >>> layout.pp, layout.dp, layout.schedule, layout.chunks, layout.balance

This module chooses; it builds no pipe (the wrappers do, from the layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipepar.batching.rules import Rules
from pipepar.core import validation
from pipepar.core.devices import DeviceSpec, resolve_devices
from pipepar.core.memory_budget import AUTO
from pipepar.core.named_schedules import NAMES
from pipepar.core.schedule import Schedule
from pipepar.core.units import format_bytes, parse_bytes
from pipepar.planner.cluster import Cluster, cluster_for, device_memory
from pipepar.planner.layout import Layout
from pipepar.planner.layout_search import CHUNKS, search_layouts
from pipepar.planner.plan import CHECKPOINTS, plan
from pipepar.planner.profile import Profile
from pipepar.planner.runtime_fit import RuntimeFit, check_runtime
from pipepar.planner.search_inputs import search_profile
from pipepar.planner.step_time import Flops

__all__ = [
    "Given",
    "capacity_bytes",
    "choose_layout",
    "given_schedule",
    "keep_layout",
    "local_layout",
    "pipe_arguments",
]


@dataclass(frozen=True)
class Given:
    """What the user fixed; ``None`` leaves it to the search.

    Example:
        >>> Given(chunks=8).chunk_counts(), Given().checkpoints()
        ([8], ['always', 'except_last', 'never'])
    """

    schedule: str | None = None
    """A schedule name of :data:`pipepar.core.named_schedules.NAMES`, or ``"auto"``."""
    chunks: int | None = None
    """Micro-batches per replica and step."""
    checkpoint: str | None = None
    """``"always"``, ``"except_last"`` or ``"never"``."""
    dp: int | None = None
    """Data-parallel replicas (``1`` for a pipe in one process)."""
    dp_shard: bool | None = None
    """Whether the replicas shard each stage's state (``dp_shard=True``) or hold it whole."""
    offload: bool | None = None
    """Whether activation offload runs (``offload=True``); None: the search tries it where
    a layout does not fit without it, on devices with memory of their own (a GPU's; not on
    the CPU, whose memory is the host's)."""

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in (*NAMES, AUTO):
            raise ValueError(
                f"schedule={self.schedule!r} is not one of {[*NAMES, AUTO]}; pass one of "
                "those, or leave it unset for the search to choose"
            )
        if self.checkpoint is not None:  # a mode, or an object whose str() is one
            object.__setattr__(self, "checkpoint", validation.check_checkpoint(self.checkpoint))
        for flag in ("dp_shard", "offload"):
            value = getattr(self, flag)
            if value is not None and not isinstance(value, bool):
                raise TypeError(
                    f"{flag} must be True, False or None (chosen by the search), got {value!r}"
                )
        for name in ("chunks", "dp"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"{name}={value!r} must be an int >= 1; pass e.g. {name}=2, or leave it "
                    "unset for the search to choose"
                )

    def shards(self) -> tuple[bool, ...]:
        """Whether to try replicas holding whole state, sharded state, or both."""
        return (False, True) if self.dp_shard is None else (self.dp_shard,)

    def offloads(self) -> tuple[bool, ...] | None:
        """Whether to try layouts without activation offload, or with it; None: the search's
        choice (``offloads`` of :func:`~pipepar.planner.layout_search.search_layouts`)."""
        return None if self.offload is None else (self.offload,)

    def schedules(self) -> list[str]:
        """The schedules to search: the one given, else every named one; for ``"auto"``
        every named one and the order built for the capacity (tried where no named V
        schedule fits)."""
        if self.schedule == AUTO:
            return [*NAMES, AUTO]
        return [self.schedule] if self.schedule else list(NAMES)

    def chunk_counts(self) -> list[int]:
        """The micro-batch counts to search: the one given, else every default one."""
        return [self.chunks] if self.chunks else list(CHUNKS)

    def checkpoints(self) -> list[str]:
        """The recompute policies to search: the one given, else every one."""
        return [self.checkpoint] if self.checkpoint else list(CHECKPOINTS)


def given_schedule(
    schedule: str | Schedule | None, chunks: int | None
) -> tuple[str | None, int | None]:
    """The schedule's name and the micro-batches a ``schedule`` argument fixes: a
    :class:`Schedule` object fixes both (its ``n_microbatches``), a name only itself.

    Raises:
        ValueError: a custom schedule (not one of the names), which the search cannot model;
            or a schedule object whose micro-batches differ from ``chunks``.

    Example:
        >>> given_schedule("1f1b", None)
        ('1f1b', None)
    """
    if not isinstance(schedule, Schedule):
        return schedule, chunks
    if schedule.name not in NAMES:
        raise ValueError(
            f"schedule is a custom Schedule ({schedule.name!r}), which the layout search "
            f"cannot model; pass balance=[...] with it, or a schedule name of {list(NAMES)}"
        )
    if chunks is not None and chunks != schedule.n_microbatches:
        raise ValueError(
            f"chunks={chunks} but the schedule given runs {schedule.n_microbatches} "
            f"micro-batches; pass chunks={schedule.n_microbatches} or leave chunks unset"
        )
    return schedule.name, schedule.n_microbatches


def choose_layout(
    model: nn.Module,
    sample: Any,
    *,
    devices: int,
    given: Given,
    cluster: Cluster,
    capacity: int,
    profile_device: str = "meta",
    runtime: RuntimeFit | None = None,
    rules: Rules | None = None,
    ranks: str | None = None,
) -> Layout:
    """The fastest layout of ``model`` on ``devices`` devices that fits ``capacity`` bytes
    each, within what ``given`` fixes; steps predicted with the ``runtime`` fit where given
    (:func:`pipepar.planner.calibrate.fit_runtime`).

    ``sample`` is one step's whole batch (all replicas' rows): each of the ``dp`` replicas
    takes ``rows / dp`` of them. The model is profiled on ``profile_device`` (measured times
    there; on ``meta`` its times come from FLOP counts at the cluster's rate). No optimizer
    state is counted, as the wrappers do not know the optimizer. ``ranks``: as
    :func:`~pipepar.planner.layout_search.search_layouts` takes it (None: one process).

    Raises:
        ValueError: when a given value cannot hold (more stages than layers, ``dp`` not
            dividing the devices or the rows, more micro-batches than rows), or nothing fits;
            the message names the value and the way out.

    Example:
        >>> layout = choose_layout(model, x, devices=2, given=Given(dp=1), cluster=c,
        ...                        capacity=2**30, profile_device="cpu")
        >>> layout.dp, sum(layout.balance) == len(model)
        (1, True)
    """
    runtime = check_runtime(runtime)
    prof, flops, runs = search_profile(
        model,
        sample,
        optimizer=None,
        device=profile_device,
        flops=None,
        chunks=given.chunk_counts(),
        rules=rules,
    )
    _check_given(given, devices, prof)
    layouts = _search(prof, flops, devices, given, cluster, capacity, runtime, runs, ranks)
    if given.dp is None:
        return layouts[0]
    chosen = [x for x in layouts if x.dp == given.dp]
    if not chosen:
        best = layouts[0]
        raise ValueError(
            f"no layout with dp={given.dp} ({devices // given.dp} devices per pipeline) fits "
            f"{devices} devices of {format_bytes(capacity)} with a batch of {prof.batch_size} "
            f"rows; the fastest that fits has pp={best.pp}, dp={best.dp} ({best}); use more "
            "or larger devices, a smaller sample batch, or another dp"
        )
    return chosen[0]


def _check_given(given: Given, devices: int, prof: Profile) -> None:
    """Values given that no layout can meet, named with the way out."""
    rows, layers = prof.batch_size, len(prof)
    if given.dp is not None:
        if devices % given.dp:
            raise ValueError(
                f"dp={given.dp} does not divide the {devices} devices; pass a dp that divides "
                f"{devices}, or leave dp unset for the search to choose"
            )
        if rows % given.dp:
            raise ValueError(
                f"dp={given.dp} does not divide the sample's {rows} rows (one step's global "
                "batch, split among the replicas); pass a sample whose rows dp divides"
            )
        pp = devices // given.dp
        if pp > layers:
            raise ValueError(
                f"devices={devices} asks for {pp} stages but the model has {layers} layers; "
                f"use at most {layers} devices{' per pipeline' if given.dp > 1 else ''}"
            )
        rows //= given.dp
    if given.chunks is not None and given.chunks > rows:
        raise ValueError(
            f"chunks={given.chunks} but the sample gives each replica {rows} rows; the sample "
            f"is one step's batch: pass a sample of the whole batch, or chunks <= {rows}"
        )


def _search(
    prof: Profile,
    flops: Flops | None,
    devices: int,
    given: Given,
    cluster: Cluster,
    capacity: int,
    runtime: RuntimeFit | None,
    chunks: list[int],
    ranks: str | None = None,
) -> list[Layout]:
    """The layouts that fit, fastest first; every one when ``dp`` is given (to filter), else
    the fastest; ``chunks``: the counts whose micro-batches the model runs. When none fits,
    the error adds why one pipeline does not fit, by layer."""
    try:
        return search_layouts(
            prof,
            devices=devices,
            batch=prof.batch_size,
            cluster=cluster,
            capacity=capacity,
            optimizer=None,
            flops=flops,
            schedules=given.schedules(),
            chunks=chunks,
            checkpoints=given.checkpoints(),
            shards=given.shards(),
            offloads=given.offloads(),
            top=None if given.dp is not None else 1,
            runtime=runtime,
            ranks=ranks,
        )
    except ValueError as error:
        raise ValueError(f"{error}; {_why_not(prof, devices, given, capacity)}") from None


def _why_not(prof: Profile, devices: int, given: Given, capacity: int) -> str:
    """Why the most frugal layout of one pipeline does not fit, in the planner's words (the
    layer or stage too big, by how much); a pointer to the whole search if it does fit."""
    dp = given.dp or 1
    rows = prof.batch_size // dp
    chunks = given.chunks or max([c for c in CHUNKS if c <= rows] or [1])
    try:
        plan(
            prof,
            devices=max(1, min(devices // dp, len(prof))),
            capacity=capacity,
            optimizer=None,
            chunks=chunks,
            schedule=_named(given.schedule),
            checkpoint=given.checkpoint or "always",
        )
    except ValueError as error:
        name, policy = _named(given.schedule), given.checkpoint or "always"
        return f"with {name}, {chunks} micro-batches and checkpoint={policy!r}: {error}"
    return "see pipepar.search_layouts(..., top=None) for the layouts considered"


def _named(schedule: str | None) -> str:
    """The named schedule that tells why nothing fits: the one given, else 1F1B (also for
    ``"auto"``, which :func:`~pipepar.planner.plan.plan` does not build)."""
    return schedule if schedule in NAMES else "1f1b"


def capacity_bytes(capacity: object, devices: int, default: int) -> int:
    """The capacity the search plans each device with: ``capacity`` (one for all, or one per
    device, of which the smallest, as the search plans identical devices), else ``default``.

    Raises:
        ValueError, TypeError: a capacity that is not a byte size, or a list of the wrong
            length; named as ``capacity`` (``capacity[i]`` for an entry).

    Example:
        >>> capacity_bytes(["1GiB", "2GiB"], 2, default=0)
        1073741824
    """
    if capacity is None:
        return default
    if isinstance(capacity, Sequence) and not isinstance(capacity, str):
        if len(capacity) != devices:
            raise ValueError(
                f"capacity has {len(capacity)} entries but there are {devices} devices; give "
                "one capacity per device, or one value for all"
            )
        given = [
            default if c is None else parse_bytes(c, name=f"capacity[{i}]")
            for i, c in enumerate(capacity)
        ]
        return min(given)
    return parse_bytes(capacity, name="capacity")  # type: ignore[arg-type]


def local_layout(
    model: nn.Module,
    sample: Any,
    *,
    devices: DeviceSpec,
    capacity: object,
    schedule: str | Schedule | None,
    chunks: int | None,
    checkpoint: str | None,
    runtime: RuntimeFit | None = None,
    rules: Rules | None = None,
    offload: bool | None = None,
) -> Layout:
    """The layout of a pipe in this process over ``devices`` (one pipeline, ``dp=1``), the
    model profiled where its parameters are; ``schedule``, ``chunks``, ``checkpoint`` and
    ``offload`` are fixed where given (not None); steps predicted with the ``runtime`` fit
    where given.

    Example:
        >>> layout = local_layout(model, torch.randn(32, 64), devices=["cpu", "cpu"],
        ...                       capacity=None, schedule=None, chunks=None, checkpoint=None)
        >>> layout.pp
        2
    """
    name, chunks = given_schedule(schedule, chunks)
    given = Given(
        schedule=name, chunks=chunks, checkpoint=checkpoint, dp=1, dp_shard=False, offload=offload
    )
    count = _device_count(devices)
    resolved = resolve_devices(devices, count)
    if not resolved:
        raise ValueError(f"devices={devices!r} names no device; pass e.g. devices=['cpu', 'cpu']")
    default = min(device_memory(d, sum(x.type == d.type for x in resolved)) for d in resolved)
    param = next(model.parameters(), None)
    where = param.device if param is not None else torch.device("cpu")
    cpu_stages = sum(d.type == "cpu" for d in resolved)
    with _threads_of_a_stage(cpu_stages if where.type == "cpu" else 0):
        return choose_layout(
            model,
            sample,
            devices=count,
            given=given,
            cluster=cluster_for(resolved[0], count),
            capacity=capacity_bytes(capacity, count, default),
            profile_device=str(where),
            runtime=runtime,
            rules=rules,
        )


def pipe_arguments(
    layout: Layout, schedule: str | Schedule | None
) -> tuple[list[int], int, str, str | Schedule, bool]:
    """What a pipe in this process takes from a chosen ``layout``: its balance, chunks,
    checkpoint, schedule and offload; a :class:`Schedule` the caller gave stays as given (the
    layout was searched with its name).

    Example:
        >>> balance, chunks, checkpoint, schedule, offload = pipe_arguments(layout, None)
    """
    chosen = schedule if isinstance(schedule, Schedule) else layout.pipe_schedule
    return list(layout.balance), layout.chunks, layout.checkpoint, chosen, layout.offload


@contextlib.contextmanager
def _threads_of_a_stage(cpu_stages: int) -> Iterator[None]:
    """Profile on the CPU with the math threads one of ``cpu_stages`` stages computing at once
    gets (the machine's shared among them), not the whole machine's: layer times as the pipe's
    workers see them. Nothing changes for 0 CPU stages."""
    if cpu_stages < 1:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, previous // cpu_stages))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _device_count(devices: DeviceSpec) -> int:
    """How many devices ``devices`` names: an int, a list's length, or for None every CUDA
    device (one CPU without CUDA)."""
    if devices is None:
        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    return 1  # resolve_devices refuses it, naming the argument


def keep_layout(pipe: nn.Module, layout: Layout | None) -> None:
    """Keep ``layout`` as ``pipe.layout``: the one chosen, or None (stages given by the user).

    Example:
        >>> keep_layout(pipe, None)
        >>> pipe.layout is None
        True
    """
    vars(pipe)["layout"] = layout  # data, not a parameter, buffer or submodule
