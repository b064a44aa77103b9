"""One traced training pass of any model, its costs attributed to the model's units.

The model's own ``forward`` runs once on the sample (a :class:`UnitCall`), under the same
:class:`~pipepar.program.cut.Cut` the pipe runs it under, with every unit as a stage of its own
(:func:`unit_forward`): each unit then owns a small autograd graph (a :class:`UnitGraph`),
whose inputs are leaves standing for what earlier units (or the code between them) handed it.
So the backward can run one unit at a time (:func:`unit_backward`), as a pipeline stage of that
one unit would, and every figure of a :class:`~pipepar.planner.layer_trace.LayerTrace` is
measured per unit the way it is per layer of an ``nn.Sequential`` (:func:`trace_units`):

- a forward pre-hook on every unit says which unit is computing (code between two units counts
  with the one before, code before the first with the first), tags the storages it creates
  (a :class:`~pipepar.planner.memory_tracker.MemoryTracker`) and those autograd saves
  (``saved_tensors_hooks``), and opens the window of its forward temporaries;
- the cut notes which unit reads each storage: a storage read by a later unit crosses into it
  (a residual stream, a rotary table, the labels reach the last unit), handed over as a value
  the unit may write into (a ``ReLU(inplace=True)`` unit after a batch norm), as in the pipe;
- the backward runs unit by unit in reverse, from the gradients later units handed back.

:func:`deferred_units` measures, from the same graphs, what each unit's split backward keeps
for W. On the meta device the pass runs under :func:`~pipepar.meta.values.meta_modes`,
so data-dependent reads and attention go as on a real device; the times of the units on a real
device are taken by :mod:`pipepar.planner.unit_timing`, over the same pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from pipepar.meta.values import meta_modes
from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.backward_clock import BackwardClock, lift
from pipepar.planner.deferred_grads import DeferredGrads, _split
from pipepar.planner.layer_trace import (
    LayerTrace,
    StorageRecord,
    _fold_inplace_successors,
    _Peak,
    _Recorder,
    _reuses,
    _use_allocator_peaks,
)
from pipepar.planner.memory_tracker import MemoryTracker, storage_key
from pipepar.program.cut import Crossing, Cut, Ledger

__all__ = [
    "Step",
    "UnitCall",
    "UnitGraph",
    "deferred_units",
    "trace_units",
    "unit_backward",
    "unit_forward",
]


@dataclass
class UnitCall:
    """One call of the model, as the profile makes it.

    Attributes:
        model: the model (left untouched: it runs with ``params`` in place of its own).
        units: the unit modules, in unit order.
        params: stand-ins for its parameters (``nn.Parameter``, so the cut knows them) and
            buffers, by name, on the profiling device.
        owner: the unit holding each stand-in parameter, by ``id``.
        args / kwargs: the sample call, on the profiling device.
        device: the profiling device.
        values: on meta, the known values of the sample's meta tensors (for
            :class:`~pipepar.meta.values.MetaScalars`).
    """

    model: nn.Module
    units: list[nn.Module]
    params: dict[str, Tensor]
    owner: dict[int, int]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    device: torch.device
    values: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def weights(self) -> list[list[Tensor]]:
        """Per unit, the stand-in parameters it holds that are trained."""
        out: list[list[Tensor]] = [[] for _ in self.units]
        seen: set[int] = set()
        for t in self.params.values():
            if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                out[self.owner.get(id(t), 0)].append(t)
        return out


@dataclass
class UnitGraph:
    """One unit's autograd graph after the forward.

    Attributes:
        outs: what the unit made that a later unit or the caller uses, needing a gradient.
        into: the crossings into the unit whose leaf needs a gradient.
        weights: the unit's own trained parameters.
    """

    outs: list[Tensor]
    into: list[Crossing]
    weights: list[Tensor]


class _Entry(torch.autograd.Function):
    """The identity from a crossing's leaf to the tensor a unit computes with: it shares the
    leaf's storage (nothing is allocated, so no figure changes) but is not a leaf, so the unit
    may write into it in place, as the pipe's units may write into their predecessor's output."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor) -> Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _UnitCut(Cut):
    """The cut with one stage per unit, telling ``on_use`` of every tensor an operation reads.

    Every unit is a stage here, also a unit without parameters that the pipe computes on the
    stage before it (a ``ReLU(inplace=True)`` after a batch norm): the leaf of a crossing that
    needs a gradient is given to the unit through :class:`_Entry`, so an in-place first
    operation writes into the value it was handed, as it does in the pipe, instead of failing
    on a leaf. Each leaf has one entry, so the unit's later uses see what it wrote.
    """

    def __init__(
        self, call: UnitCall, ledger: Ledger, on_use: Callable[[Tensor, int], None] | None
    ) -> None:
        super().__init__(ledger, call.owner, [call.device] * len(call.units), {})
        self.on_use = on_use
        self.entries: dict[int, Tensor] = {}  # by id of the leaf (held by its crossing)

    def _cross(self, t: Tensor) -> Tensor:
        if self.on_use is not None:
            self.on_use(t, self.stage)
        leaf = super()._cross(t)
        if leaf is t or isinstance(t, nn.Parameter) or not leaf.requires_grad:
            return leaf  # the unit's own, a tied weight (never written into), or no gradient
        entry = self.entries.get(id(leaf))
        if entry is None:
            entry = self.entries[id(leaf)] = _Entry.apply(leaf)
            self._tag(entry)  # the unit's own from now on
        return entry


@contextlib.contextmanager
def _hooks(
    units: Sequence[nn.Module],
    on_enter: Callable[[int], None],
    on_exit: Callable[[int, Any, Any], None] | None = None,
) -> Iterator[None]:
    """Call ``on_enter(i)`` when unit ``i`` starts a later unit than the one computing (a unit
    called again, or a later one called early, stays with the one computing), and
    ``on_exit(i, inputs, output)`` after every unit call."""
    current = [0]

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if i > current[0]:
                current[0] = i
                on_enter(i)

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if on_exit is not None:
                on_exit(i, (args, kwargs), output)

        return hook

    handles = [u.register_forward_pre_hook(pre(i), with_kwargs=True) for i, u in enumerate(units)]
    handles += [u.register_forward_hook(post(i), with_kwargs=True) for i, u in enumerate(units)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def unit_forward(
    call: UnitCall,
    on_enter: Callable[[int], None],
    on_exit: Callable[[int, Any, Any], None] | None = None,
    on_use: Callable[[Tensor, int], None] | None = None,
) -> tuple[list[UnitGraph], list[tuple[Tensor, Tensor]], Any]:
    """The model's forward, cut at every unit; returns the units' graphs, the seeds of the
    backward (output, gradient) and the model's output.

    Args:
        call: the call to make.
        on_enter: ``on_enter(i)`` when unit ``i`` starts computing (``on_enter(0)`` first).
        on_exit: ``on_exit(i, inputs, output)`` after every call of unit ``i``.
        on_use: ``on_use(t, i)`` for every tensor an operation of unit ``i`` reads.
    """
    ledger = Ledger()
    cut = _UnitCut(call, ledger, on_use)

    def enter(i: int) -> None:
        cut.stage = i
        on_enter(i)

    on_enter(0)
    with torch.enable_grad(), _hooks(call.units, enter, on_exit), cut:
        output = functional_call(call.model, call.params, call.args, call.kwargs)
    cut.entries.clear()  # the graphs hold what they need; the storages may go with them
    seeds = [(t, torch.ones_like(t)) for t in _seed_tensors(output)]
    producers = [_producer(ledger, t, len(call.units)) for t, _ in seeds]
    graphs = _graphs(ledger, call, list(zip(producers, (t for t, _ in seeds))))
    return graphs, seeds, output


def _seed_tensors(output: Any) -> list[Tensor]:
    """Where the backward starts: the model's own loss when it returns one (transformers
    models given ``labels=``), else every floating-point output that needs a gradient."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, Tensor) and loss.requires_grad:
        return [loss]
    leaves = tree_leaves(output)
    return [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]


def _producer(ledger: Ledger, t: Tensor, n: int) -> int:
    made = ledger.stage_of(t)
    return n - 1 if made is None else made


def _graphs(ledger: Ledger, call: UnitCall, outputs: list[tuple[int, Tensor]]) -> list[UnitGraph]:
    """Each unit's graph, from the ledger's crossings; the ledger is emptied (the graphs hold
    what the units hold, and no more)."""
    weights = call.weights()
    graphs = [UnitGraph([], [], w) for w in weights]
    seen: set[int] = set()
    sources = [(c.producer, c.original) for c in ledger.crossings if not c.is_param]
    for producer, t in [*sources, *outputs]:
        if producer >= 0 and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            graphs[producer].outs.append(t)
    for c in ledger.crossings:
        if c.leaf.requires_grad:
            graphs[c.consumer].into.append(c)
    ledger.forget()
    return graphs


Step = Callable[[int, list[Tensor], list[Tensor], list[Tensor], list[Tensor]], Sequence[Any]]
"""``step(i, outs, grads, inputs, weights)``: unit ``i``'s backward; the inputs' gradients."""


def unit_backward(graphs: list[UnitGraph], seeds: list[tuple[Tensor, Tensor]], step: Step) -> None:
    """Run the units' backwards in reverse, each from the gradients later units handed back
    (summed over the units that used a value), as the pipe's stages do; every unit's graph
    is let go once it ran."""
    grads = {id(t): g for t, g in seeds}
    for i in reversed(range(len(graphs))):
        graph = graphs[i]
        outs = [t for t in graph.outs if id(t) in grads]
        out_grads = [grads.pop(id(t)) for t in outs]
        ins = [c.leaf for c in graph.into]
        result = step(i, outs, out_grads, ins, graph.weights) if outs else []
        del outs, out_grads
        for c, g in zip(graph.into, result):
            if g is not None and not c.is_param and c.producer >= 0:
                key = id(c.original)
                grads[key] = g if key not in grads else grads[key] + g
        del result, ins
        graph.outs, graph.into = [], []


# -- the traced pass --------------------------------------------------------------------------
class _Tracer:
    """The traced pass's bookkeeping: which unit runs, its forward window, uses and outputs."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.tracker = MemoryTracker()
        self.rec = _Recorder(self.tracker)
        self.tracker.on_new = self.rec.on_new
        self.probe = _Peak(self.tracker, device)
        self.traces = [LayerTrace() for _ in range(n)]
        self.window: tuple[int, Any] | None = None
        self.versions: dict[int, list[int]] = {}

    def enter(self, i: int) -> None:
        self.close()
        self.rec.layer = i
        self.probe.start()
        scope = torch.profiler.record_function(f"pipepar:F{i}")
        scope.__enter__()
        self.window = (i, scope)

    def close(self) -> None:
        if self.window is None:
            return
        i, scope = self.window
        self.window = None
        scope.__exit__(None, None, None)
        trace = self.traces[i]
        trace.forward_peak = max(trace.forward_peak, self.probe.peak() - self.probe.now())

    def use(self, t: Tensor, unit: int) -> None:
        if t.layout != torch.strided or t.is_nested:
            return
        record = self.rec.records.get(storage_key(t))
        if record is not None and unit > record.creator:
            record.last_output = max(unit - 1, record.last_output or -1)

    def exit(self, i: int, inputs: Any, output: Any) -> None:
        trace = self.traces[i]
        if trace.output_shape is None:  # the first call of a unit
            tensors = _tensors(output)
            trace.output_shape = _shapes(output)
            trace.output_bytes = sum(_nbytes(t) for t in tensors)
        before = self.versions.pop(i, None)
        if before is not None and before != [t._version for t in _tensors(inputs)]:
            trace.modifies_input = True

    def handed_out(self, output: Any, n: int) -> None:
        """The model's output goes to the caller: held by the last unit's stage."""
        for t in _tensors(output):
            record = self.rec.records.get(storage_key(t))
            if record is not None:
                record.last_output = n - 1


def trace_units(call: UnitCall) -> tuple[list[LayerTrace], list[StorageRecord]]:
    """Run the model's forward and the units' backwards once, recording storages and peaks.

    Returns:
        Per-unit traces (bytes for the whole sample) and the storage records, with
        ``creator``/``first_saver`` the unit computing when a storage was made/saved and
        ``last_output`` one before the last unit that read it.
    """
    n = len(call.units)
    tr = _Tracer(n, call.device)
    for t in _tensors((call.args, call.kwargs)):
        tr.rec.records.setdefault(storage_key(t), StorageRecord(-1, _nbytes(t), False, -1))
    own_profiler = torch._C._autograd._profiler_enabled()
    cpu = call.device.type == "cpu" and not own_profiler
    log = AllocatorLog() if cpu else contextlib.nullcontext()
    pre = _versions_hook(tr)
    saving = torch.autograd.graph.saved_tensors_hooks(tr.rec.pack, lambda t: t)
    with meta_modes(call.device, call.values), log, tr.tracker, saving:
        with _version_hooks(call.units, pre):
            graphs, seeds, output = unit_forward(call, tr.enter, tr.exit, tr.use)
        tr.close()
        tr.handed_out(output, n)
        del output
        tr.rec.recording = False
        unit_backward(graphs, seeds, _traced_step(tr))
        del graphs, seeds
    if isinstance(log, AllocatorLog):
        _use_allocator_peaks(log, tr.traces)
    _fold_inplace_successors(tr.traces)
    return tr.traces, tr.rec.all_records()


def _versions_hook(tr: _Tracer) -> Callable[[int, Any], None]:
    def note(i: int, inputs: Any) -> None:
        tr.versions[i] = [t._version for t in _tensors(inputs)]

    return note


@contextlib.contextmanager
def _version_hooks(units: Sequence[nn.Module], note: Callable[[int, Any], None]) -> Iterator[None]:
    """Note the version counters of every unit call's inputs (to see in-place units)."""

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            note(i, (args, kwargs))

        return hook

    handles = [u.register_forward_pre_hook(pre(i), with_kwargs=True) for i, u in enumerate(units)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _traced_step(tr: _Tracer) -> Step:
    def step(
        i: int, outs: list[Tensor], grads: list[Tensor], ins: list[Tensor], weights: list[Tensor]
    ) -> Sequence[Any]:
        trace = tr.traces[i]
        # The incoming gradient is live during this backward: count it as the unit's.
        trace.incoming_grad_bytes = sum(_nbytes(g) for g in grads)
        before = tr.probe.start() - trace.incoming_grad_bytes
        clock = BackwardClock(tr.tracker, weights, before)
        with torch.profiler.record_function(f"pipepar:B{i}"), clock:
            result = torch.autograd.grad(outs, ins + weights, grads, allow_unused=True)
        made = sum(_nbytes(g) for g in result[len(ins) :] if g is not None)
        trace.grads_bytes = made
        trace.backward_peak = max(0, tr.probe.peak() - before - made)
        trace.backward_points, trace.retained_points = lift(
            clock.points(), clock.retained_points(), trace.backward_peak + made
        )
        trace.reuses_grad = _reuses(result[: len(ins)], grads)
        return result[: len(ins)]

    return step


# -- split backwards --------------------------------------------------------------------------
def deferred_units(call: UnitCall) -> list[DeferredGrads]:
    """What each unit's split backward (zero-bubble B) keeps for W, as
    :func:`pipepar.planner.deferred_grads.deferred_grads` measures it per layer; ``call``
    should be on meta (sizes only), or on a real device where the model cannot run on meta."""
    found = []
    # The backwards too under the meta modes (their meta kernels); tracked from the forwards
    # on, so that B's frees of what they saved count in its peak.
    with meta_modes(call.device, call.values), MemoryTracker() as tracker:
        graphs, _, output = unit_forward(call, lambda i: None)
        del output
        for graph in graphs:
            ins = tuple(c.leaf for c in graph.into)
            outs = tuple(_as_handed(t) for t in graph.outs)
            found.append(_split(outs, ins, graph.weights, tracker=tracker))
            graph.outs, graph.into = [], []
    return found


def _as_handed(t: Tensor) -> Tensor:
    """An output that an operation returned as it was handed to the unit (an eval-mode
    dropout's input) is the leaf it stands for, as it would be in a stage of its own."""
    node = t.grad_fn
    if isinstance(node, _Entry._backward_cls):
        return node.next_functions[0][0].variable
    return t


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def _shapes(value: Any) -> Any:
    if isinstance(value, Tensor):
        return tuple(int(d) for d in value.shape)
    return tuple(tuple(int(d) for d in t.shape) for t in _tensors(value))


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
