"""One traced training pass over a sequence of layers: who creates, keeps and frees what.

The forward pass runs the layers in a chain, as ``nn.Sequential`` does, under a
:class:`~pipepar.memory_tracker.MemoryTracker` and ``saved_tensors_hooks``: every new storage is
tagged with the layer that created it, every storage autograd saves is tagged as kept. The
backward pass then runs one layer at a time (``torch.autograd.grad`` from the layer's outputs to
its inputs and parameters), which is exactly the backward of a pipeline stage of one layer.

Layers are called through ``torch.func.functional_call`` with stand-in parameters and buffers,
so the user's model is never modified (no ``.grad``, no running-stat updates) and can stay on
another device (``meta`` planning of a CPU model copies nothing).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from pipepar.meta.attention import FusedAttention
from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.backward_clock import BackwardClock, Points, lift
from pipepar.planner.memory_tracker import MemoryTracker, storage_key

__all__ = ["StorageRecord", "LayerTrace", "trace_layers", "time_layers", "stand_ins"]


@dataclass
class StorageRecord:
    """One storage that matters to a pipeline: kept for backward, or handed between layers.

    Attributes:
        creator: index of the layer whose forward created it (-1: the input sample).
        nbytes: its size.
        saved: whether autograd keeps it for backward.
        last_output: the last layer whose output refers to it (-1: only the input), or None.
        first_saver: the first layer that keeps it for backward (its backward frees it once
            every later saver ran), or None.
    """

    creator: int
    nbytes: int
    saved: bool = False
    last_output: int | None = None
    first_saver: int | None = None


@dataclass
class LayerTrace:
    """Raw per-layer figures from one traced pass (bytes are for the whole sample batch)."""

    output: Any = None
    output_shape: Any = None
    output_bytes: int = 0
    forward_peak: int = 0
    backward_peak: int = 0
    backward_inner: int = 0
    grads_bytes: int = 0
    incoming_grad_bytes: int = 0
    modifies_input: bool = False
    reuses_grad: bool = False
    backward_points: Points = ()
    retained_points: Points = ()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def stand_ins(layer: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Parameters and buffers to call ``layer`` with on ``device``, leaving ``layer`` untouched.

    Parameters already on ``device`` are used as they are (no copy); others are copied
    (``meta`` copies cost nothing). Buffers are always copied, since training-mode layers such
    as BatchNorm update them in place.

    Example:
        >>> sorted(stand_ins(nn.Linear(2, 3), torch.device("meta")))
        ['bias', 'weight']
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in layer.named_parameters():
        out[name] = param if param.device == device else _copy(param, device, param.requires_grad)
    for name, buffer in layer.named_buffers():
        out[name] = _copy(buffer, device, False)
    return out


def _copy(tensor: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    if device.type == "meta":
        copy = torch.empty_like(tensor, device=device)
    else:
        copy = tensor.detach().to(device, copy=True)
    return copy.requires_grad_(requires_grad)


class _Recorder:
    """Bookkeeping shared by the tracker callback and the saved-tensor hook."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.layer = -1
        self.recording = True
        self.records: dict[int, StorageRecord] = {}  # live storages by key
        self.retired: list[StorageRecord] = []  # freed ones whose address was reused

    def on_new(self, key: int, nbytes: int) -> None:
        if not self.recording:
            return
        old = self.records.pop(key, None)
        if old is not None:  # the allocator reused a freed storage's address
            self.retired.append(old)
        self.records[key] = StorageRecord(creator=self.layer, nbytes=nbytes)

    def all_records(self) -> list[StorageRecord]:
        return self.retired + list(self.records.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        record = self.records.get(storage_key(tensor))
        if record is not None:  # parameters and buffers have no record: they are not activations
            record.saved = True
            if record.first_saver is None:
                record.first_saver = self.layer
        return tensor


class _Peak:
    """Peak bytes above a starting point: from the tracker, or from the CUDA allocator.

    The CUDA allocator also sees kernel workspaces (cuBLAS, cuDNN) that no dispatch mode can.
    """

    def __init__(self, tracker: MemoryTracker, device: torch.device) -> None:
        self.tracker = tracker
        self.cuda = device if device.type == "cuda" else None
        if self.cuda is not None:
            _create_cublas_workspaces(self.cuda)

    def start(self) -> int:
        self.tracker.reset_peak()
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)
            return int(torch.cuda.memory_allocated(self.cuda))
        return self.tracker.live_bytes

    def peak(self) -> int:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            return int(torch.cuda.max_memory_allocated(self.cuda))
        return self.tracker.peak_bytes

    def now(self) -> int:
        if self.cuda is not None:
            return int(torch.cuda.memory_allocated(self.cuda))
        return self.tracker.live_bytes


def trace_layers(
    layers: Sequence[nn.Module],
    sample: Any,
    params: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
) -> tuple[list[LayerTrace], list[StorageRecord]]:
    """Run forward then backward over ``layers`` and record storages and per-layer peaks.

    Args:
        layers: the layers, called in order on the previous output.
        sample: the first layer's input (a tensor or a tuple of tensors), already on the
            profiling device; it is not modified.
        params: per layer, the stand-in tensors from :func:`stand_ins`.
        device: the profiling device (CUDA peaks come from the CUDA allocator).

    Returns:
        Per-layer traces and the storage records (creator, size, kept, handed on).
    """
    tracker = MemoryTracker()
    rec = _Recorder(tracker)
    tracker.on_new = rec.on_new
    for tensor in _tensors(sample):
        rec.records.setdefault(storage_key(tensor), StorageRecord(-1, _nbytes(tensor), False, -1))
    traces = [LayerTrace() for _ in layers]
    probe = _Peak(tracker, device)
    inputs: list[Any] = []
    # The CPU allocator's events need torch.profiler; never take over the user's own session.
    own_profiler = torch._C._autograd._profiler_enabled()
    log = AllocatorLog() if device.type == "cpu" and not own_profiler else contextlib.nullcontext()
    fused = FusedAttention() if device.type == "meta" else contextlib.nullcontext()
    with log, tracker, fused, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        x = sample
        for i, layer in enumerate(layers):
            inputs.append(x)
            x = _traced_forward(i, layer, x, params[i], rec, probe, traces[i])
        del x
        rec.recording = False
        _traced_backward(layers, inputs, params, probe, traces)
        inputs.clear()
    if isinstance(log, AllocatorLog):
        _use_allocator_peaks(log, traces)
    _fold_inplace_successors(traces)
    for trace in traces:
        trace.output = None
    return traces, rec.all_records()


def _create_cublas_workspaces(device: torch.device) -> None:
    """Have cuBLAS make its workspaces for this thread and the autograd engine's thread.

    cuBLAS allocates one workspace per thread and stream (32 MiB on Hopper) at its first
    matrix product there, through the caching allocator. A pipe allocates it in its first step
    and keeps it; without this, the profile would count it in whichever layer's forward or
    backward first multiplies matrices.
    """
    with torch.cuda.device(device), torch.enable_grad():
        a = torch.ones(8, 8, device=device, requires_grad=True)
        torch.autograd.grad((a @ a).sum(), a)
        torch.cuda.synchronize(device)


def _fold_inplace_successors(traces: list[LayerTrace]) -> None:
    """The backward of a layer followed by in-place layers (``Conv`` + ``ReLU_``) inside a stage.

    An in-place layer's backward node runs inside the previous layer's backward (autograd
    rebased the history onto the shared tensor), and it consumes the incoming gradient first,
    which autograd then frees; our per-layer call keeps it alive for the whole window. So the
    window's peak counts it once too often after that first node: take the peak without it,
    or the in-place node's own (the incoming gradient and one like it). That holds when the
    incoming gradient is the previous layer's; when it is the stage's, the engine holds it.
    """
    for i, t in enumerate(traces):
        t.backward_inner = t.backward_peak
        after = traces[i + 1] if i + 1 < len(traces) else None
        if after is not None and after.modifies_input and after.reuses_grad:
            incoming = t.incoming_grad_bytes
            t.backward_inner = max(t.backward_peak - incoming, min(t.backward_peak, 2 * incoming))


def _use_allocator_peaks(log: AllocatorLog, traces: list[LayerTrace]) -> None:
    """On CPU, take peaks from the allocator: it also sees kernels' scratch buffers."""
    for i, trace in enumerate(traces):
        fwd = log.window(f"pipepar:F{i}")
        trace.forward_peak = max(trace.forward_peak, fwd.rise - fwd.net)
        bwd = log.window(f"pipepar:B{i}")
        if bwd.rise:
            extra = bwd.rise + trace.incoming_grad_bytes - trace.grads_bytes
            trace.backward_peak = max(trace.backward_peak, extra)
            trace.backward_points, trace.retained_points = lift(
                trace.backward_points,
                trace.retained_points,
                trace.backward_peak + trace.grads_bytes,
            )


def _traced_forward(
    i: int,
    layer: nn.Module,
    x: Any,
    params: dict[str, torch.Tensor],
    rec: _Recorder,
    probe: _Peak,
    trace: LayerTrace,
) -> Any:
    rec.layer = i
    versions = [t._version for t in _tensors(x)]
    probe.start()
    with torch.profiler.record_function(f"pipepar:F{i}"):
        try:
            out = functional_call(layer, params, (x,))
        except (RuntimeError, TypeError, IndexError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) failed on an input of shape {_shapes(x)}: "
                f"{first}; check the sample's shape and dtype"
            ) from err
    trace.forward_peak = max(0, probe.peak() - probe.now())
    for tensor in _tensors(out):
        record = rec.records.get(storage_key(tensor))
        if record is not None:
            record.last_output = i
    trace.modifies_input = versions != [t._version for t in _tensors(x)]
    trace.output = out
    trace.output_shape = _shapes(out)
    trace.output_bytes = sum(_nbytes(t) for t in _tensors(out))
    return out


def _traced_backward(
    layers: Sequence[nn.Module],
    inputs: list[Any],
    params: Sequence[dict[str, torch.Tensor]],
    probe: _Peak,
    traces: list[LayerTrace],
) -> None:
    grads: dict[int, torch.Tensor] = {}  # id(tensor) -> gradient flowing into it
    for i in reversed(range(len(layers))):
        outs, out_grads = _outputs_with_grads(traces[i].output, grads, last=i == len(layers) - 1)
        traces[i].output = None
        if not outs:
            continue
        ins = [t for t in _tensors(inputs[i]) if t.requires_grad]
        weights = [p for p in params[i].values() if p.requires_grad]
        # The incoming gradient is live during this backward: count it as the layer's.
        traces[i].incoming_grad_bytes = sum(_nbytes(g) for g in out_grads)
        before = probe.start() - traces[i].incoming_grad_bytes
        clock = BackwardClock(probe.tracker, weights, before)
        with torch.profiler.record_function(f"pipepar:B{i}"), clock:
            result = torch.autograd.grad(outs, ins + weights, out_grads, allow_unused=True)
        param_grads = sum(_nbytes(g) for g in result[len(ins) :] if g is not None)
        traces[i].grads_bytes = param_grads
        traces[i].backward_peak = max(0, probe.peak() - before - param_grads)
        traces[i].backward_points, traces[i].retained_points = lift(
            clock.points(), clock.retained_points(), traces[i].backward_peak + param_grads
        )
        traces[i].reuses_grad = _reuses(result[: len(ins)], out_grads)
        del outs, out_grads
        grads = {id(t): g for t, g in zip(ins, result) if g is not None}
        del result
        inputs[i] = None


def _reuses(input_grads: Sequence[torch.Tensor | None], out_grads: list[torch.Tensor]) -> bool:
    """Whether the gradients handed back share memory with the ones that came in (views,
    in-place layers): then no new gradient exists while the layers before run backward."""
    given = [g for g in input_grads if g is not None]
    incoming = {storage_key(g) for g in out_grads}
    return bool(given) and all(storage_key(g) in incoming for g in given)


def _outputs_with_grads(
    output: Any, grads: dict[int, torch.Tensor], *, last: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs, out_grads = [], []
    for tensor in _tensors(output):
        if not tensor.requires_grad:
            continue
        grad = torch.ones_like(tensor) if last else grads.get(id(tensor))
        if grad is not None:
            outs.append(tensor)
            out_grads.append(grad)
    return outs, out_grads


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    return ()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def time_layers(
    layers: Sequence[nn.Module],
    sample: Any,
    params: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
) -> list[tuple[float, float]]:
    """Wall-clock (forward_ms, backward_ms) per layer, one untraced pass, on a real device.

    Example:
        >>> layers = [nn.Linear(4, 4), nn.ReLU()]
        >>> len(time_layers(layers, torch.ones(2, 4), [stand_ins(m, torch.device("cpu"))
        ...     for m in layers], torch.device("cpu")))
        2
    """
    sync = _synchronizer(device)
    forward, outputs, inputs = [], [], []
    x = sample
    for i, layer in enumerate(layers):
        inputs.append(x)
        sync()
        start = time.perf_counter()
        x = functional_call(layer, params[i], (x,))
        sync()
        forward.append((time.perf_counter() - start) * 1e3)
        outputs.append(x)
    del x
    backward = [0.0] * len(layers)
    grads: dict[int, torch.Tensor] = {}
    for i in reversed(range(len(layers))):
        outs, out_grads = _outputs_with_grads(outputs[i], grads, last=i == len(layers) - 1)
        outputs[i] = None
        if not outs:
            continue
        ins = [t for t in _tensors(inputs[i]) if t.requires_grad]
        weights = [p for p in params[i].values() if p.requires_grad]
        sync()
        start = time.perf_counter()
        result = torch.autograd.grad(outs, ins + weights, out_grads, allow_unused=True)
        sync()
        backward[i] = (time.perf_counter() - start) * 1e3
        grads = {id(t): g for t, g in zip(ins, result) if g is not None}
        inputs[i] = None
    return list(zip(forward, backward))


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
