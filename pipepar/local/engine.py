"""One mini-batch through the pipeline: the forward and backward actions and their autograd glue.

Each (stage j, micro-batch i) forward starts from a fresh leaf (the detached input), so every
stage owns a small autograd graph per micro-batch. The caller sees a single autograd node,
:class:`_PipeFunction`, whose inputs are the batch and the parameters: when ``loss.backward()``
reaches it, the stages run their own backward passes (concurrently, on their workers), the
parameter gradients are summed over micro-batches, and the node hands them to autograd on the
caller's thread. So ``.grad`` accumulation, gradient hooks and DDP behave as with the plain model.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipepar.core.microbatch import Value, map_tensors, tensors
from pipepar.core.recompute import RngState, private_stream, recomputing, should_checkpoint
from pipepar.core.stage import Stage
from pipepar.local.transfer import move
from pipepar.local.worker import Slots
from pipepar.tracing.tracer import Tracer

__all__ = ["Autocast", "Run"]

Grads = tuple[Tensor | None, ...]


@dataclass(frozen=True)
class Autocast:
    """The caller's autocast settings, re-entered on the worker threads (they are thread-local)."""

    states: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> Autocast:
        kinds = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return cls(
            tuple((k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k))
        )

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        if not self.states:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for kind, dtype in self.states:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        return stack


@dataclass
class _Record:
    """What a stage keeps of one micro-batch's forward until its backward."""

    input: Value
    output: Value | None  # None when checkpointed: recomputed in backward
    rng: RngState | None


def _leaf(value: Value, requires_grad: bool) -> Value:
    def detach(t: Tensor) -> Tensor:
        d = t.detach()
        return d.requires_grad_() if requires_grad and d.is_floating_point() else d

    return map_tensors(value, detach)


class Run:
    """The state of one mini-batch: micro-batch inputs, per-stage records, gradient sums."""

    def __init__(
        self,
        stages: Sequence[Stage],
        microbatches: list[Value],
        *,
        checkpoint: str,
        grad: bool,
        input_requires_grad: bool,
        blocking: bool,
        tracer: Tracer | None = None,
    ) -> None:
        self.stages, self.m = list(stages), len(microbatches)
        self.checkpoint, self.grad = checkpoint, grad
        self.input_requires_grad = input_requires_grad
        self.training = any(layer.training for s in stages for layer in s.layers)
        self.autocast = Autocast.capture()
        self.tracer = tracer
        # Random stages on several threads would race for the global generator: give each
        # (stage, micro-batch) a stream of its own, seeded here on the caller's thread.
        racing = self.training and sum(s.stochastic for s in stages) > 1
        self.seed = int(torch.randint(2**62, ())) if racing else None
        self.acts = Slots(blocking=blocking)
        self.grads = Slots(blocking=blocking)
        for i, x in enumerate(microbatches):
            self.acts.put((0, i), x)
        self.records: list[dict[int, _Record]] = [{} for _ in stages]
        self.params = [s.trainable() for s in stages]
        self.param_grads: list[list[Tensor | None]] = [[None] * len(p) for p in self.params]
        self._owned: list[list[bool]] = [[False] * len(p) for p in self.params]
        self.out_sizes: list[int] = []

    # -- forward ------------------------------------------------------------------------------
    def forward(self, j: int, i: int) -> None:
        """Stage ``j`` runs micro-batch ``i`` forward and hands the result to stage ``j+1``."""
        stage = self.stages[j]
        x: Value = self._receive(self.acts, j, i, stage.device)  # type: ignore[assignment]
        start = time.perf_counter()
        keep = self.grad and (j > 0 or self.input_requires_grad)
        leaf = _leaf(x, keep) if self.grad else x
        ckpt = self.grad and self.training and should_checkpoint(self.checkpoint, i, self.m)
        rng = None
        with self._random(stage, i), _on(stage.device), self.autocast():
            # Only random stages touch the generator: they hold RNG_LOCK, and a save/restore
            # by another thread without it would clobber their state (and their masks).
            rng = RngState.capture(stage.device) if ckpt and stage.stochastic else None
            with torch.set_grad_enabled(self.grad and not ckpt):
                y = stage.run(stage.protect(leaf) if self.grad else leaf)
        if self.grad:
            self.records[j][i] = _Record(leaf, None if ckpt else y, rng)
            y = map_tensors(y, Tensor.detach)
        self.acts.put((j + 1, i), y)
        self._trace(j, i, "forward", start)

    def _random(self, stage: Stage, i: int) -> contextlib.AbstractContextManager[Any]:
        """The RNG lock and, when training, a stream of the stage's own for micro-batch ``i``."""
        if self.seed is None or not stage.stochastic:
            return stage.rng_guard()
        stack = contextlib.ExitStack()
        stack.enter_context(stage.rng_guard())
        stack.enter_context(private_stream(stage.device, self.seed + stage.index * self.m + i))
        return stack

    def outputs(self) -> list[Value]:
        """The last stage's outputs, in micro-batch order (after the forward actions ran)."""
        k = len(self.stages)
        outs: list[Value] = [self.acts.take((k, i)) for i in range(self.m)]  # type: ignore[misc]
        self.out_sizes = [tensors(v)[0].shape[0] for v in outs]
        return outs

    # -- backward -----------------------------------------------------------------------------
    def seed_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """Split the gradient of the joined output into per-micro-batch gradients."""
        parts = [g.split(self.out_sizes) if g is not None else [None] * self.m for g in grads]
        for i in range(self.m):
            self.grads.put((len(self.stages) - 1, i), tuple(p[i] for p in parts))

    def backward(self, j: int, i: int) -> None:
        """Stage ``j`` back-propagates micro-batch ``i`` and hands the input gradient to ``j-1``."""
        stage = self.stages[j]
        g: Grads = self._receive(self.grads, j, i, stage.device)  # type: ignore[assignment]
        start = time.perf_counter()
        rec = self.records[j].pop(i)
        y = rec.output if rec.output is not None else self._recompute(stage, rec, i)
        pairs = [(t, gt) for t, gt in zip(tensors(y), g) if t.requires_grad and gt is not None]
        inputs = [t for t in tensors(rec.input) if t.requires_grad]
        grads_in: list[Tensor | None] = [None] * len(inputs)
        if pairs:
            outs = [t for t, _ in pairs]
            gouts = [gt for _, gt in pairs]
            with _on(stage.device):
                result = torch.autograd.grad(
                    outs, [*inputs, *self.params[j]], gouts, allow_unused=True
                )
            grads_in = list(result[: len(inputs)])
            shared = [*gouts, *(g for g in grads_in if g is not None)]
            self._accumulate(j, result[len(inputs) :], shared)
        it = iter(grads_in)
        aligned = tuple(next(it) if t.requires_grad else None for t in tensors(rec.input))
        self.grads.put((j - 1, i), aligned)
        self._trace(j, i, "backward", start)

    def _recompute(self, stage: Stage, rec: _Record, i: int) -> Value:
        start = time.perf_counter()
        with (
            stage.rng_guard(),
            rec.rng.replay() if rec.rng is not None else contextlib.nullcontext(),
            recomputing(stage.layers),
            _on(stage.device),
            torch.enable_grad(),
            self.autocast(),
        ):
            y = stage.run(stage.protect(rec.input))
        self._trace(stage.index, i, "recompute", start)
        return y

    def _accumulate(self, j: int, grads: Sequence[Tensor | None], shared: Sequence[Tensor]) -> None:
        sums, owned = self.param_grads[j], self._owned[j]
        present = [g for g in grads if g is not None]
        uses = Counter(t.untyped_storage().data_ptr() for t in [*shared, *present])
        for k, g in enumerate(grads):
            if g is None:
                continue
            if sums[k] is None:
                # A fresh, dense gradient whose storage nothing else in this backward uses is
                # summed into in place later on (no new buffer per micro-batch); one that
                # shares its storage is replaced by a new sum, never written to.
                sums[k] = g
                owned[k] = uses[g.untyped_storage().data_ptr()] == 1 and _whole(g)
            elif owned[k]:
                sums[k].add_(g)  # type: ignore[union-attr]
            else:
                sums[k], owned[k] = sums[k] + g, True  # type: ignore[operator]

    def input_grads(self) -> list[Tensor | None]:
        """Gradients of the pipeline's input tensors (after all backward actions ran)."""
        per_mb: list[Grads] = [self.grads.take((-1, i)) for i in range(self.m)]  # type: ignore[misc]
        columns = list(zip(*per_mb))
        return [None if any(g is None for g in col) else torch.cat(col) for col in columns]  # type: ignore[arg-type]

    def all_param_grads(self) -> list[Tensor | None]:
        """Per-parameter gradient sums, stage by stage, in :attr:`params` order."""
        return [g for stage_grads in self.param_grads for g in stage_grads]

    def _receive(self, slots: Slots, j: int, i: int, device: torch.device) -> object:
        """Wait for stage ``j``'s input of micro-batch ``i`` and bring it to ``device``."""
        start = time.perf_counter()
        value = slots.take((j, i))
        got = time.perf_counter()
        self._trace(j, i, "wait", start, got)
        if _off_device(value, device):
            value = _to(value, device)
            self._trace(j, i, "transfer", got)
        return value

    def _trace(self, j: int, i: int, kind: str, start: float, end: float | None = None) -> None:
        if self.tracer is not None:
            self.tracer.record(j, i, kind, start, time.perf_counter() if end is None else end)


def _whole(g: Tensor) -> bool:
    """True if ``g`` is dense, contiguous and spans its whole storage (a weight gradient is
    often a transposed view of a fresh product that covers all of it)."""
    return (
        g.layout == torch.strided
        and g.is_contiguous()
        and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    )


def _items(value: object) -> tuple[Tensor | None, ...]:
    return (value,) if isinstance(value, Tensor) else value  # type: ignore[return-value]


def _off_device(value: object, device: torch.device) -> bool:
    return any(t is not None and t.device != device for t in _items(value))


def _to(value: object, device: torch.device) -> object:
    """Move a value (or a tuple of gradients, some None) to ``device``."""
    if isinstance(value, Tensor):
        return move(value, device)
    return tuple(None if t is None else move(t, device) for t in _items(value))


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward_order(k: int, m: int) -> list[list[tuple[int, int]]]:
    """GPipe's forward: stage j runs micro-batches 0..m-1 (per-stage action lists)."""
    return [[(j, i) for i in range(m)] for j in range(k)]


def backward_order(k: int, m: int) -> list[list[tuple[int, int]]]:
    """GPipe's backward: stage j runs micro-batches m-1..0 (per-stage action lists)."""
    return [[(j, i) for i in reversed(range(m))] for j in range(k)]


def wavefront(per_stage: list[list[tuple[int, int]]], forward: bool) -> list[tuple[int, int]]:
    """Interleave per-stage lists into one order a single thread can run without waiting."""
    k = len(per_stage)
    order = []
    for step in range(max(len(a) for a in per_stage) + k - 1):
        for j in range(k) if forward else reversed(range(k)):
            lag = j if forward else k - 1 - j
            t = step - lag
            if 0 <= t < len(per_stage[j]):
                order.append(per_stage[j][t])
    return order
