"""``pipepar.wrap``: any model becomes a :class:`~pipepar.pipe.Pipe`, its layout given
(``balance`` or ``split``) or chosen from a sample
(:func:`pipepar.planner.auto_layout.local_layout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from pipepar.batching.rules import InputRule, OutputRule, Rules
from pipepar.core import validation
from pipepar.core.compiled_units import CompileOption, compile_units, compiler_of, take_compiled
from pipepar.core.devices import DeviceSpec
from pipepar.core.memory_budget import AUTO, auto_schedule, refuse_searched
from pipepar.core.schedule import Schedule
from pipepar.local.chain import is_chain
from pipepar.pipe import Pipe

if TYPE_CHECKING:
    from pipepar.planner.layout import Layout
    from pipepar.planner.runtime_fit import RuntimeFit

__all__ = ["wrap"]


def wrap(
    module: nn.Module,
    balance: Sequence[int] | None = None,
    *,
    devices: DeviceSpec = None,
    chunks: int | None = None,
    checkpoint: str | None = None,
    deferred_batch_norm: bool = False,
    batch_coupling: str = "error",
    split_inputs: Mapping[str | int, InputRule] | None = None,
    join_outputs: Mapping[str, OutputRule] | None = None,
    sample: Any = None,
    split: Sequence[str] | None = None,
    split_spec: Mapping[str, Any] | None = None,
    capacity: Any = None,
    schedule: str | Schedule | None = None,
    memory_budget: float | str | None = None,
    recompute: str = "in_place",
    threads: int | None = None,
    trace: bool = False,
    runtime: RuntimeFit | None = None,
    gc_every: int | None = None,
    compile: CompileOption = None,
    offload: bool | None = None,
) -> Pipe:
    """Split ``module`` into pipeline stages and return the pipe.

    One :class:`Pipe` class for every model: an ``nn.Sequential`` takes the same arguments as
    ``torchgpipe.GPipe`` and runs as a chain of its layers; any other model is called with
    its own arguments and returns what it returns, its forward code cut into stages as it
    runs. With ``balance=None`` and ``split=None`` the model is profiled on ``sample`` where
    its parameters are and the layout is chosen (:func:`pipepar.search_layouts` with one
    pipeline over the devices): what you pass is fixed, what you leave unset (``chunks``,
    ``schedule``, ``checkpoint``) is chosen, with the balance, for the fastest predicted step
    that fits ``capacity``. The chosen :class:`~pipepar.planner.layout.Layout` is
    ``pipe.layout`` (``print(pipe.layout)``); it is None when ``balance`` or ``split`` is given.

    Args:
        module: the model to split; its layers are moved to their stage's device.
        balance: layers (units, for other models: see :func:`pipepar.units`) per stage, e.g.
            ``[3, 3, 2]``; ``None`` to use ``split`` or to plan it from ``sample``.
        split: module paths where a new stage begins, e.g. ``["transformer.h.6"]``.
        split_spec: as torch.distributed.pipelining's ``pipeline()`` takes it, instead of
            ``split``: ``{"transformer.h.6": SplitPoint.BEGINNING}`` (a stage begins at that
            module's first unit) or ``SplitPoint.END`` (at the unit after it); each path a
            unit or a module holding units. With none of ``balance``, ``split`` and
            ``split_spec``, ``pipe_split()`` calls in the forward split it where they stand,
            between two unit calls: the forward runs once on ``sample`` as given to find them
            (the model and the random states left as they were; a marker inside a unit is a
            ValueError), and
            they take the place of the searched layout (``chunks``, ``schedule`` and
            ``checkpoint`` as with ``split``).
        devices: one device per stage; ``None`` = all CUDA devices, or the CPU for every stage.
            A searched layout runs one pipeline over all of them.
        chunks: micro-batches per mini-batch (M); ``None``: chosen by the search, or 1 when
            ``balance`` or ``split`` is given.
        checkpoint: which micro-batches recompute their activations in backward:
            ``"always"``, ``"except_last"`` (the default for ``nn.Sequential``, as in
            torchgpipe) or ``"never"`` (the default for other models, which then recompute
            unit by unit: each unit keeps its arguments and runs again in backward, drawing
            the same random numbers). ``None``: chosen by the search, or that default when
            ``balance`` or ``split`` is given.
        deferred_batch_norm: track batch-norm statistics over the whole mini-batch.
        batch_coupling: what to do with an operation of the model that mixes rows of the
            batch (contrastive logits, a batch mean, batch norm in training, router statistics
            over all tokens), found at the first call of a kind: ``"error"`` (the default)
            stops there with :class:`~pipepar.BatchCoupled`; ``"per-micro-batch"`` lets each
            micro-batch compute it on its own rows (its values join weighted by rows).
        split_inputs: how arguments that are not rows of the batch are cut into
            micro-batches, by parameter name (or position): ``"rows"``, ``"whole"`` (the same
            to every micro-batch), :class:`~pipepar.Packed` (items of every row packed one
            after another, e.g. the patches of all images) or ``fn(value, pieces)``. Without
            one, a tensor with the batch's rows on dimension 0 is cut into rows and anything
            else goes whole; the packed inputs of known multimodal models are recognised.
        join_outputs: how output leaves are joined, by name or key path: ``"concat"``,
            ``"sum"`` or ``fn(values)``; without one, what the outputs show (rows
            concatenated, a loss by its shares, a packed output in micro-batch order).
        sample: an input batch to profile when ``balance`` is None: a tensor, a tuple of
            positional arguments, or a dict of keyword arguments (``dict(input_ids=...)``).
            It stands for one step's batch: the search chooses ``chunks`` up to its rows.
            Planning leaves ``module`` as it was passed (:mod:`pipepar.core.untouched`).
        capacity: bytes per device for planning (int, ``"16GiB"``, or one per device, of
            which the search plans with the smallest); default: a CUDA device's memory, or
            this machine's memory shared among the CPU stages.
        threads: math threads per CPU stage; default: ``torch.get_num_threads()`` shared among
            the CPU stages that compute at once on average (``round(K*M/(M+K-1))``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``, ``"zb-v"``,
            ``"v-half"``, ``"v-min"`` or a :class:`~pipepar.core.schedule.Schedule`. The
            virtual-stage ones (all from ``"interleaved-1f1b"`` on) place several stages on
            each device: ``balance`` then lists 2 (or more) stages per device. Their memory
            bound and bubble apply to :meth:`Pipe.step`; ``pipe(x)`` runs all forwards first.
            ``None``: chosen by the search, or ``"gpipe"`` when ``balance`` or ``split`` is
            given. ``"auto"`` (with ``balance`` or ``split``): the fastest order found within
            ``memory_budget``, its stages taken as equally fast; with twice as many stages as
            ``devices`` a V (as ``"zb-v"``) or a loop (as ``"interleaved-1f1b"``) may be
            chosen. ``"auto"`` with ``sample`` and no stages: the search tries the named
            schedules and, where no named V fits, the order built for what each device has
            left of ``capacity`` (``pipe.layout.order``; no ``memory_budget`` then).
        memory_budget: with ``schedule="auto"``, what each device may hold of its stages'
            micro-batches at once, between a micro-batch's forward and its last backward
            action: a number of micro-batches of all the device's stages (1F1B's first device
            holds ``min(K, chunks)``), a share of 1F1B's (``"50%"``), or activation bytes
            (``"2GiB"``: the planner's predicted peak of each device less its parameters,
            gradients and optimizer state, from a profile of ``sample`` on ``meta``; ``sample``
            must be given); None: ``"100%"``. Below one micro-batch on all
            of a device's stages it is a ValueError naming the least. The schedule is built
            here for ``chunks`` micro-batches (a shorter batch is refused, as with a
            :class:`~pipepar.core.schedule.Schedule`).
        recompute: where checkpointed micro-batches run their stage again: ``"in_place"``
            (the default) at the start of their backward, on the critical path; or
            ``"bubbles"``: as ``R`` actions of the schedule, each in the latest time its
            device would idle before that backward (on a simulated clock, with the stages'
            times measured in the first training step), never holding more rebuilt
            micro-batches at once than in place. The same numbers either way. Any model: an
            ``nn.Sequential``'s stage runs again whole; other models' checkpointed units run
            again one by one, as inside backward.
        trace: record a timeline of every action in ``pipe.tracer``.
        runtime: with ``sample`` (a searched layout): what this machine's runtime adds to each
            action, fitted to steps you measured (:func:`pipepar.planner.fit_runtime`); the
            search then ranks layouts by those predictions. Default: the profile's times.
        gc_every: Python's cycle collector during ``pipe.step``: ``None`` (default) leaves it
            as it is; ``N`` turns it off while a step runs, collects what the step left after
            it, and runs a full collection every ``N`` steps (e.g. 100), so its pauses come
            at known steps (:mod:`pipepar.core.garbage`).
        compile: compile each unit's ``forward`` (a layer of an ``nn.Sequential``, a block):
            True for ``torch.compile``'s defaults, or a dict of its keyword arguments
            (``{"backend": "inductor", "mode": "max-autotune"}``). A model or its modules
            compiled before ``wrap`` keep their own options, moved onto the units
            (:mod:`pipepar.core.compiled_units`); ``compile=`` compiles the others.
        offload: send what each micro-batch's forward saves for its backward to host memory
            while the stage runs other actions, and have it back one action before its
            backward, as the schedule's action lists say (:mod:`pipepar.core.offload_plan`;
            on CUDA through pinned memory on a side stream). The numbers are unchanged. With
            ``checkpoint`` unset nothing is recomputed. See the memory guide. ``None``:
            chosen by the search (only where a layout does not fit without it, and only on
            devices with memory of their own: never on CPU devices, whose memory is the
            host's, so offload frees nothing there), or False when ``balance`` or ``split``
            is given. ``True`` offloads on any device.

    Returns:
        The :class:`Pipe`: called like the model (``pipe(x)``, ``pipe(**batch)``), trained
        with :meth:`Pipe.step` or ``backward()`` on what it returns, with the model's
        ``named_parameters()`` and ``state_dict()`` keys; ``pipe.layout`` is the searched
        layout (None when ``balance`` or ``split`` is given).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``schedule`` is neither a name nor a
            :class:`~pipepar.core.schedule.Schedule`; ``split_inputs``/``join_outputs``
            given for an ``nn.Sequential`` split by ``balance``.
        ValueError: an argument that does not fit the model or the others (a ``balance``
            that does not sum to the layers or units, a ``split`` path that is not where a
            unit begins, ``chunks``, ``checkpoint`` or ``threads`` out of range, no
            ``balance``, ``split`` or ``sample`` for a model without ``pipe_split()``
            markers, no layout that fits ``capacity``); the message names the argument,
            both values and a fix.
        DeviceError: a device torch does not know, or CUDA where there is none.

    A model's first call of a kind can raise :class:`~pipepar.BatchCoupled` or
    :class:`~pipepar.LossNotJoinable` (before any gradient) where micro-batching would
    change the result.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
        >>> pipe = pipepar.wrap(model, [4, 4], devices=["cpu", "cpu"], chunks=4)
        >>> pipe(torch.randn(32, 16)).sum().backward()
        >>> pipe = pipepar.wrap(model, sample=torch.randn(32, 16), devices=2)  # chosen
        >>> print(pipe.layout)  # doctest: +SKIP
        pp=2 dp=1 1f1b M=4 recompute=never: ...
    """
    default_compiler = compiler_of(compile)
    module, compilers = take_compiled(module)
    chain = is_chain(module, split, sample)
    layout = None
    if schedule == AUTO and balance is None and split is None and split_spec is None:
        refuse_searched(schedule, memory_budget)
    if split_spec is not None or (balance is None and split is None):
        # Only a layout to find loads the planner (and, for any model, the cut): a chain with
        # its balance given runs without either.
        from pipepar.planner.auto_layout import local_layout, pipe_arguments
        from pipepar.planner.split_points import torch_split

        split = (
            torch_split(module, balance, split, split_spec, sample, call_order=True, chain=chain)
            or split
        )
        if balance is None and split is None:
            layout = local_layout(
                validation.check_model(module) if chain else module,
                _sample_to_plan(sample, chain),
                devices=devices,
                capacity=capacity,
                schedule=schedule,
                chunks=chunks,
                checkpoint=checkpoint,
                runtime=runtime,
                rules=Rules.given(split_inputs, join_outputs),
                offload=offload,
            )
            balance, chunks, checkpoint, schedule, offload = pipe_arguments(layout, schedule)
    stages = len(balance) if balance is not None else None if split is None else len(split) + 1
    workers = _device_count(devices, stages)
    schedule = auto_schedule(
        schedule,
        memory_budget,
        n_stages=stages,
        chunks=1 if chunks is None else chunks,
        n_workers=workers,
        sized=lambda size: _sized(
            module, sample, balance, chunks, checkpoint, chain, workers, size
        ),
    )
    pipe = Pipe(
        module,
        balance,
        split=split,
        devices=devices,
        chunks=1 if chunks is None else chunks,
        sample=sample,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        batch_coupling=batch_coupling,
        split_inputs=split_inputs,
        join_outputs=join_outputs,
        schedule="gpipe" if schedule is None else schedule,
        recompute=recompute,
        threads=threads,
        trace=trace,
        gc_every=gc_every,
        offload=False if offload is None else offload,
    )
    _keep_layout(pipe, layout)
    compile_units(list(pipe), compilers, default_compiler, module)
    return pipe


def _keep_layout(pipe: Pipe, layout: Layout | None) -> None:
    """``pipe.layout``: the layout chosen, or None (stages given by the user)."""
    vars(pipe)["layout"] = layout  # data, not a parameter, buffer or submodule


def _sample_to_plan(sample: Any, chain: bool) -> Any:
    """``sample``, which a searched layout needs; else the ValueError with the fix."""
    if sample is not None:
        return sample
    if chain:
        raise ValueError(
            "balance is None and no sample was given; pass balance=[...] (layers per stage) "
            "or sample=<an input batch> so pipepar can profile the model and choose the layout"
        )
    raise ValueError(
        "balance and split are None and no sample was given; pass split=[module paths "
        "where stages begin], balance=[units per stage] (pipepar.units(model) lists the "
        "units), or sample=<an input batch> so pipepar can profile the model and choose "
        "the layout (or, when the forward calls pipe_split(), find where the calls stand)"
    )


def _device_count(devices: DeviceSpec, stages: int | None) -> int:
    """The devices a pipe of ``stages`` stages runs on: those given, else one per stage."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    return stages or 1


def _sized(
    module: nn.Module,
    sample: Any,
    balance: Sequence[int] | None,
    chunks: int | None,
    checkpoint: str | None,
    chain: bool,
    workers: int,
    size: int,
) -> Schedule:
    """The schedule for a budget in bytes (loads the planner: a size only)."""
    from pipepar.planner.stage_activations import bytes_schedule

    return bytes_schedule(module, sample, balance, chunks, checkpoint, budget=size,
                          n_workers=workers, chain=chain)  # fmt: skip
