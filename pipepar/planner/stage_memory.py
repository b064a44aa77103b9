"""How much memory one pipeline stage needs at its peak, from a :class:`~pipepar.profile.Profile`.

A stage ``j`` holding layers ``a..b`` on its device keeps, across one training step:

- always: parameters ``P`` and optimizer state ``O``;
- from its first backward to the optimizer step: gradients ``G``;
- per micro-batch in flight (``m`` = M under GPipe, ``min(M, K - j)`` under 1F1B):
  its input, plus without checkpointing everything autograd saved inside the stage and its
  output (the engine keeps both until the micro-batch's backward). Under checkpointing only the
  input is kept, and one micro-batch at a time is recomputed to full activations in backward.

The peak is the largest of four moments, each counted per byte of storage (a storage shared by
two layers counts once; one that crosses a stage boundary counts on both devices):

- forward: in-flight activations + the largest forward temporary (+ ``G`` under 1F1B, where
  forwards follow backwards);
- first backward: in-flight activations (one micro-batch recomputed, if checkpointed) + ``G``
  + the largest backward temporary;
- second backward: as the first, plus the engine's gradient sum: each backward makes a new
  ``G``, added in place to the running sum as it is made, alive until the backward returns;
- optimizer step: ``G`` + the step's temporaries (per tensor on CPU, all at once with the
  ``foreach`` kernels torch picks on CUDA).

Activation figures of the profile are for its whole batch ``B``; they are scaled by
``ceil(B / M) / B`` to one micro-batch. The loss and its gradient are not counted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import accumulate

from pipepar.core.schedule import Schedule, make
from pipepar.planner.profile import Profile

__all__ = ["StageMemory", "MemoryModel", "in_flight"]


@dataclass(frozen=True)
class StageMemory:
    """Predicted memory of one stage; ``peak_bytes`` is the sum of the five parts.

    Attributes:
        params_bytes: parameters.
        grads_bytes: parameter gradients.
        optimizer_bytes: optimizer state.
        activation_bytes: activations of the micro-batches in flight at the peak.
        transient_bytes: temporaries at the peak (layer work space, gradient sums, optimizer
            step), beyond the four parts above.
        peak_bytes: the predicted peak of the stage's device.
        in_flight: micro-batches whose activations the stage holds at once.
        phase: the moment of the peak: "forward", "backward" or "optimizer".
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int
    in_flight: int
    phase: str


def in_flight(schedule: str, chunks: int, stages: int, j: int) -> int:
    """Micro-batches stage ``j`` holds at once, read off the schedule itself
    (:mod:`pipepar.core.schedule`): M for GPipe, min(M, K - j) for 1F1B and ZB-H1.

    Example:
        >>> in_flight("1f1b", 8, 4, 1)
        3
    """
    return _schedule(schedule, chunks, stages).in_flight(j)


@functools.lru_cache(maxsize=256)
def _schedule(name: str, chunks: int, stages: int) -> Schedule:
    return make(name, stages, chunks, n_workers=stages)


class _RangeMax:
    """Maximum of a list over any index range in O(1) (a sparse table)."""

    def __init__(self, values: list[int]) -> None:
        self.table = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2

    def __call__(self, a: int, b: int) -> int:
        """max(values[a..b]), both ends included."""
        level = (b - a + 1).bit_length() - 1
        row = self.table[level]
        return max(row[a], row[b - (1 << level) + 1])


def _prefix(values: list[int]) -> list[int]:
    return [0, *accumulate(values)]


class MemoryModel:
    """Answers "what does stage j over layers a..b peak at?" in O(1) per question.

    Args:
        prof: the profile (whole-batch figures).
        chunks: micro-batches M.
        stages: number of stages K.
        schedule: "gpipe", "1f1b" or "zb-h1" (one stage per device).
        checkpoint: "always", "except_last" or "never".
        foreach: per stage, whether the optimizer step runs its multi-tensor kernels.

    Example:
        >>> model = MemoryModel(prof, chunks=4, stages=2, schedule="gpipe",
        ...                     checkpoint="never", foreach=[False, False])
        >>> model.stage(0, 0, 1).peak_bytes > 0
        True
    """

    def __init__(
        self,
        prof: Profile,
        *,
        chunks: int,
        stages: int,
        schedule: str,
        checkpoint: str,
        foreach: list[bool],
    ) -> None:
        self.chunks, self.stages = chunks, stages
        self.schedule, self.checkpoint, self.foreach = schedule, checkpoint, foreach
        rows = max(prof.batch_size, 1)
        self.scale = math.ceil(rows / chunks) / rows
        layers = prof.layers
        n = self.n_layers = len(layers)
        self.startable = [i == 0 or not x.modifies_input for i, x in enumerate(layers)]
        self._p = _prefix([x.params_bytes for x in layers])
        self._g = _prefix([x.grads_bytes for x in layers])
        self._o = _prefix([x.optimizer_bytes for x in layers])
        self._step_multi = _prefix([x.optimizer_step_foreach_bytes for x in layers])
        self._step_loop = _RangeMax([x.optimizer_step_bytes for x in layers])
        self._fwd = _RangeMax([x.forward_peak_bytes for x in layers])
        self._out = [x.output_bytes for x in layers]
        self._build_storages(prof, n)
        # Backward of layer i inside a stage ending at b: what layers i+1..b saved is freed,
        # and the gradients of layers i..b exist. Range maxima of the i-dependent parts.
        # Activations scale with the micro-batch, gradients do not; the scale is fixed here.
        r = self.scale
        self._bwd_last = [x.backward_peak_bytes for x in layers]
        self._bwd_freed = _RangeMax(
            [
                round(r * (x.backward_peak_bytes + self._freed[i + 1])) - self._g[i]
                for i, x in enumerate(layers)
            ]
        )
        self._bwd_inner_freed = _RangeMax(
            [
                round(r * (x.backward_inner_bytes + self._freed[i + 1])) - self._g[i]
                for i, x in enumerate(layers)
            ]
        )
        # new_grad_upto[b]: the last layer <= b whose backward makes a new input gradient.
        last = -1
        self._new_grad_upto = []
        for i, layer in enumerate(layers):
            last = last if layer.reuses_grad else i
            self._new_grad_upto.append(last)

    def _build_storages(self, prof: Profile, n: int) -> None:
        saved, freed = [0] * n, [0] * n
        entering = [0] * (n + 2)  # difference array: bytes entering layer a (its input)
        self._unsaved_out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self._kept_out = [0] * n  # saved by layer b and part of its output: lives on
        for s in prof.storages:
            if s.saved and s.creator >= 0:
                saved[s.creator] += s.nbytes
            if s.first_saver is not None and s.creator >= 0:
                freed[s.first_saver] += s.nbytes
                if s.last_output is not None and s.last_output >= s.first_saver:
                    self._kept_out[s.first_saver] += s.nbytes
            if s.last_output is not None:
                # In the input of layers creator+1 .. last_output+1.
                entering[s.creator + 1] += s.nbytes
                entering[s.last_output + 2] -= s.nbytes
                if not s.saved and s.creator >= 0:
                    for b in range(s.creator, min(s.last_output, n - 1) + 1):
                        self._unsaved_out[b].append((s.creator, s.nbytes))
        self._saved = _prefix(saved)
        self._freed = _prefix(freed)
        self._input = list(accumulate(entering))[: n + 1]

    def held(self, a: int, b: int) -> tuple[int, int]:
        """(full, checkpointed) bytes one whole-batch "micro-batch" keeps on stage a..b."""
        stage_input = self._input[a]
        inside = self._saved[b + 1] - self._saved[a]
        output = sum(nbytes for creator, nbytes in self._unsaved_out[b] if creator >= a)
        return stage_input + inside + output, stage_input

    def stage(self, j: int, a: int, b: int) -> StageMemory:
        """Predicted peak of stage ``j`` holding layers ``a..b`` (inclusive)."""
        m = in_flight(self.schedule, self.chunks, self.stages, j)
        full, ckpt = (round(x * self.scale) for x in self.held(a, b))
        # Stage 0's micro-batches are views of the whole batch, resident for the whole step:
        # count the batch once instead of one micro-batch input per micro-batch in flight.
        batch = self._input[0] - m * ckpt if a == 0 else 0
        params, grads = self._p[b + 1] - self._p[a], self._g[b + 1] - self._g[a]
        opt = self._o[b + 1] - self._o[a]
        n_full, n_ckpt = self._split(m)
        # In flight at the end of the forward, and while the first backward runs.
        forward_act = n_full * full + n_ckpt * ckpt + batch
        # Recomputing a checkpointed micro-batch brings back its full activations; under GPipe
        # the whole one (except_last) has already gone by then, under 1F1B it is still here.
        recompute = n_ckpt > 0 and (n_full == 0 or self.schedule != "gpipe")
        backward_act = forward_act - ckpt + full if recompute else forward_act
        fwd = round(self._fwd(a, b) * self.scale)
        bwd = self._backward_with_new_grads(a, b)
        steady = grads if self.schedule != "gpipe" and self.chunks > m else 0
        # The first backward creates the gradients; later ones add new ones to the sums.
        backward = backward_act + bwd
        if self.chunks > 1:
            summed = backward_act - full + ckpt + round(self._out[b] * self.scale)
            backward = max(backward + grads, summed + 2 * grads)
        phases = {
            "forward": forward_act + fwd + steady,
            "backward": backward,
            "optimizer": grads + self._step(j, a, b),
        }
        phase = max(phases, key=phases.__getitem__)
        act = max(forward_act, backward_act)
        base = params + opt + grads + act
        peak = max(params + opt + phases[phase], base)
        return StageMemory(params, grads, opt, act, peak - base, peak, m, phase)

    def _backward_with_new_grads(self, a: int, b: int) -> int:
        """Peak of one micro-batch's backward beyond what the stage holds for it, including
        the parameter gradients it creates (scaled to a micro-batch, except gradients).

        The last layer's backward starts with everything held. When layer i < b runs, the
        gradient that arrived for the stage's output is still alive (the engine holds it),
        what layers i+1..b were the first to save is already freed (unless it is the stage's
        output, which the engine also holds), and layers i..b have made their gradients.
        """
        grads_b = self._g[b + 1] - self._g[b]
        last = round(self._bwd_last[b] * self.scale) + grads_b
        if a == b:
            return last
        tail = self._freed[b + 1] - self._kept_out[b]
        # Layers after q only hand the stage's incoming gradient on (in place, views): for
        # layers from q on, that gradient is their own incoming one, already in their figure.
        q = max(self._new_grad_upto[b], a)
        best = last
        for lo, hi, table, extra in (
            (a, q - 1, self._bwd_inner_freed, self._out[b]),
            (q, b - 1, self._bwd_freed, 0),
        ):
            if lo <= hi:
                best = max(
                    best, table(lo, hi) + round(self.scale * (extra - tail)) + self._g[b + 1]
                )
        return best

    def _split(self, m: int) -> tuple[int, int]:
        """(micro-batches kept whole, micro-batches kept as inputs only) among ``m``."""
        if self.checkpoint == "never":
            return m, 0
        if self.checkpoint == "always":
            return 0, m
        return 1, m - 1  # except_last: only the last micro-batch keeps its activations

    def _step(self, j: int, a: int, b: int) -> int:
        if self.foreach[j]:
            return self._step_multi[b + 1] - self._step_multi[a]
        return self._step_loop(a, b)

    def static_bytes(self, a: int, b: int) -> int:
        """Parameters + gradients + optimizer state of layers a..b (a lower bound of the peak)."""
        return (
            self._p[b + 1] - self._p[a] + self._g[b + 1] - self._g[a] + self._o[b + 1] - self._o[a]
        )
