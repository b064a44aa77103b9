"""How much memory a device needs at its peak, from a :class:`~pipepar.profile.Profile` and the
schedule it runs.

Two halves. *Figures*: what one micro-batch of a stage holding layers ``a..b`` costs, read in
O(1) from prefix sums and range maxima over the profile, each storage counted once (a storage
shared by two layers counts once; one that crosses a stage boundary counts on both devices):

- always: parameters ``P`` and optimizer state ``O``;
- ``whole``: a micro-batch held with its graph: its input, everything autograd saved inside the
  stage and its output (the engine keeps both until the micro-batch's backward);
  ``inputs``: a checkpointed one, its input only (stage 0's inputs are views of the batch,
  resident for the whole step: counted once, ``batch``);
- ``waits``: a micro-batch waiting for W after B of a split backward (zero-bubble): the graph
  and the gradients recorded at the weight operations (:mod:`pipepar.planner.deferred_grads`);
  when no parameter needs autograd again in W (only matrix products, computed *directly* from
  their saved inputs), B does not keep the graph and the micro-batch holds only those saved
  inputs and the recorded gradients; on stage 0, whose input needs no gradient, B does nothing
  and the micro-batch waits whole, with the incoming gradient;
- transients: a forward's work space; a whole backward's peak with the parameter gradients it
  makes (``G``, unscaled); the end of a whole backward (its input gradient, the incoming
  gradient and the new ``G`` alive, its activations freed); B of a split backward (the gradients
  it records and the input gradient; inside each layer at least B's own peak measured on the
  split, :mod:`pipepar.planner.deferred_grads`: it keeps what W reads, which the points of a
  whole backward have freed by then); W (the ``G`` it makes; on stage 0 the whole backward,
  freeing as it goes); the optimizer step (per tensor on
  CPU, all at once with the ``foreach`` kernels torch picks on CUDA). Once the stage's gradient
  sums exist, a direct product adds into its sum in place (``addmm_``): ``summed`` are the same
  transients without those gradients (W always; an unsplit backward only on a stage with a
  weight matrix of ``2**17`` elements, where the runtime takes that route).

*Moments* (:mod:`pipepar.planner.peak_moments`): the schedule's own action list says, at each
action, how many micro-batches each stage holds whole, as inputs or waiting for W, and whether
its gradient sums exist. The peak is the largest moment, figures weighed by those counts. So
GPipe's first backward holds all ``M`` micro-batches but no gradient sums yet, and the second
one ``M - 1`` micro-batches plus the sums; 1F1B's stage ``j`` holds ``min(M, K - j)``; ZB-H1 the
same, a micro-batch waiting for W with its recorded gradients; a device with two stages (ZB-V,
interleaved 1F1B) both stages' micro-batches at each moment of its one list.

Activation figures of the profile are for its whole batch ``B``; they are scaled by
``ceil(B / M) / B`` to one micro-batch. The loss and its gradient are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipepar.core.offload import MIN_BYTES
from pipepar.core.schedule import Schedule
from pipepar.core.step import LARGE_MATRIX
from pipepar.planner.peak_moments import Moment, offload_of, worker_moments
from pipepar.planner.posted_receives import PostedReceives, receives_of
from pipepar.planner.profile import LayerProfile, Profile

__all__ = ["Figures", "MemoryModel", "StageMemory"]


@dataclass(frozen=True)
class StageMemory:
    """Predicted memory of one stage at its device's peak; ``peak_bytes`` is the sum of the
    five parts, and a device's peak the sum of its stages' ``peak_bytes``.

    Attributes:
        params_bytes: parameters.
        grads_bytes: parameter gradients.
        optimizer_bytes: optimizer state.
        activation_bytes: activations the stage holds at the peak (net of what the backward
            running then has already freed, when the peak comes before all gradients exist),
            across ranks with the buffers of the receives it has posted ahead.
        transient_bytes: the rest of the peak: work space, gradients being made, gradients
            recorded for W, the optimizer step.
        peak_bytes: the stage's part of its device's peak.
        in_flight: micro-batches whose activations the stage holds at once (the schedule's).
        phase: the moment of the peak: "forward", "backward", "backward_end", "input_grad",
            "weight" or "optimizer".
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int
    in_flight: int
    phase: str


@dataclass(frozen=True)
class Figures:
    """What stage ``a..b`` costs: static bytes, and per micro-batch (gradients unscaled)."""

    params: int
    grads: int
    optimizer: int
    batch: int
    whole: int
    inputs: int
    waits: int
    away: int
    output: int
    splits: bool
    transient: dict[str, int]
    summed: dict[str, int]
    step_loop: int
    step_multi: int

    def held(self, m: Moment, at: int) -> int:
        """Activation bytes held at moment ``m`` by the stage at position ``at`` of its worker."""
        waiting = m.waiting[at] * self.waits
        away = m.away[at] * self.away  # offload: its input and output stay
        return m.whole[at] * self.whole + m.inputs[at] * self.inputs + waiting + away + self.batch


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


def _split_peak(layer: LayerProfile, r: float) -> int:
    """B's own peak as measured on the split itself, at ``r`` times the profiled batch: it
    keeps what W reads and the gradients it records, which the points of a whole backward
    have freed once used (0 where not measured)."""
    return round(r * layer.split_input_peak_bytes)


def _input_grad_peak(layer: LayerProfile, r: float) -> int:
    """The most bytes other than parameter gradients a layer's backward holds when it keeps
    the graph, at ``r`` times the profiled batch (B of a split backward makes no parameter
    gradients)."""
    if not layer.retained_points:
        return max(round(r * layer.backward_peak_bytes), _split_peak(layer, r))
    return max(round(r * max(other for other, _ in layer.retained_points)), _split_peak(layer, r))


def _backward_peak(layer: LayerProfile, r: float, *, new: int | None = None) -> int:
    """A layer's backward peak, its gradients included, at ``r`` times the profiled batch;
    ``new``: at most that many gradient bytes are new tensors (the rest added into sums in
    place)."""
    points = layer.backward_points
    cap = layer.grads_bytes if new is None else new
    if not points:  # a profile from before the points, or built by hand
        return round(r * layer.backward_peak_bytes) + cap
    return max(round(r * other) + min(grads, cap) for other, grads in points)


def _freeing_peak(layer: LayerProfile, r: float) -> int:
    """A layer's backward peak without parameter gradients, freeing what it saved: B of a
    split backward that does not keep the graph (at least B's own measured peak)."""
    if not layer.backward_points:
        return max(round(r * layer.backward_peak_bytes), _split_peak(layer, r))
    return max(max(round(r * other) for other, _ in layer.backward_points), _split_peak(layer, r))


@dataclass(frozen=True)
class _Sweep:
    """A backward running a stage's layers from its last one down, as range maxima over the
    layer ``i`` running: its own peak ``own[i]`` (``inner[i]`` when the incoming gradient came
    from a layer of the stage), plus what layers ``i+1..`` left alive (prefix sums ``left``:
    gradients made, or bytes kept for W), minus what they were the first to save (``freed``
    prefix sums, scaled). See :meth:`MemoryModel._sweep`."""

    own: list[int]
    left: list[int]
    outer: _RangeMax
    inner: _RangeMax

    @classmethod
    def of(cls, own: list[int], cut: list[int], left: list[int], freed: list[int]) -> _Sweep:
        n = len(own)
        base = [own[i] + freed[i + 1] - left[i + 1] for i in range(n)]
        return cls(own, left, _RangeMax(base), _RangeMax([base[i] - cut[i] for i in range(n)]))


class MemoryModel:
    """Answers "what does stage j over layers a..b peak at?" in O(1) per question.

    Args:
        prof: the profile (whole-batch figures).
        schedule: the schedule (:func:`pipepar.core.named_schedules.make`); its micro-batches are M.
        checkpoint: "always", "except_last" or "never".
        foreach: per worker, whether the optimizer step runs its multi-tensor kernels.
        offload: whether activation offload runs (``pipepar.wrap(..., offload=True)``): a
            micro-batch sent out holds its input only until it is brought back.
        ranks: the runtime across ranks the devices are (``"program"``: ``pipepar.distributed``
            on any model; ``"chain"``: on an ``nn.Sequential``), whose receives posted ahead
            of their messages a device also holds (:mod:`pipepar.planner.posted_receives`);
            None: one process.

    Example:
        >>> model = MemoryModel(prof, make("gpipe", 2, 4, n_workers=2), checkpoint="never",
        ...                     foreach=[False, False])
        >>> model.stage(0, 0, 1).peak_bytes > 0
        True
    """

    def __init__(
        self,
        prof: Profile,
        schedule: Schedule,
        *,
        checkpoint: str,
        foreach: Sequence[bool],
        offload: bool = False,
        ranks: str | None = None,
    ) -> None:
        self.schedule, self.checkpoint, self.foreach = schedule, checkpoint, list(foreach)
        receives = receives_of(ranks)
        self.posted = None if receives is None else PostedReceives(receives, schedule)
        self.offload = offload_of(schedule) if offload else None
        self.chunks, self.stages = schedule.n_microbatches, schedule.n_stages
        self._in_flight = [schedule.in_flight(s) for s in range(schedule.n_stages)]
        self._walked: dict[tuple[int, tuple[bool, ...]], Sequence[Moment]] = {}
        self._figures: dict[tuple[int, int], Figures] = {}
        rows = max(prof.batch_size, 1)
        self.scale = math.ceil(rows / self.chunks) / rows
        layers = prof.layers
        n = self.n_layers = len(layers)
        self.startable = [i == 0 or not x.modifies_input for i, x in enumerate(layers)]
        self._p = _prefix([x.params_bytes for x in layers])
        self._g = _prefix([x.grads_bytes for x in layers])
        self._o = _prefix([x.optimizer_bytes for x in layers])
        self._kept = _prefix([x.deferred_grad_bytes for x in layers])
        self._generic = _prefix([x.generic_params for x in layers])
        self._large = _prefix([int(x.largest_matrix >= LARGE_MATRIX) for x in layers])
        self._direct = _prefix([x.direct_grad_bytes for x in layers])
        self._whole_direct = _prefix([x.whole_direct_grad_bytes for x in layers])
        self._saved_direct = _prefix([x.direct_saved_bytes for x in layers])
        self._unsplit = _prefix([0 if x.splits_backward else 1 for x in layers])
        self._step_multi = _prefix([x.optimizer_step_foreach_bytes for x in layers])
        self._step_loop = _RangeMax([x.optimizer_step_bytes for x in layers])
        self._fwd = _RangeMax([x.forward_peak_bytes for x in layers])
        self._out = [x.output_bytes for x in layers]
        self._keeps_incoming = [x.keeps_incoming_grad for x in layers]
        self._build_storages(prof, n)
        # Backward of layer i inside a stage ending at b: what layers i+1..b saved is freed,
        # and the gradients of layers i..b exist. Range maxima of the i-dependent parts.
        # Activations scale with the micro-batch, gradients do not; the scale is fixed here.
        r = self.scale
        freed = [round(r * f) for f in self._freed]
        cut = [round(r * (x.backward_peak_bytes - x.backward_inner_bytes)) for x in layers]
        new = [x.grads_bytes - x.whole_direct_grad_bytes for x in layers]
        self._new = _Sweep.of([_backward_peak(x, r) for x in layers], cut, self._g, freed)
        # The same once the gradient sums exist, on a stage taking the direct route.
        self._summed = _Sweep.of(
            [_backward_peak(x, r, new=g) for x, g in zip(layers, new)], cut, _prefix(new), freed
        )
        # B not keeping the graph: no parameter gradients, but the gradients recorded for W
        # and the direct products' saved inputs stay (added back where they would be freed).
        keep = [round(r * (x.deferred_grad_bytes + s)) for x, s in zip(layers, self._saved_at)]
        own = [_freeing_peak(x, r) for x in layers]
        self._freeing = _Sweep.of(own, cut, _prefix(keep), freed)
        # B of a split backward: layer i's gradients other than parameter ones (graph kept),
        # with what layers i+1..b recorded for W still alive.
        self._input_only = [_input_grad_peak(x, r) for x in layers]
        self._input_only_tail = _RangeMax(
            [self._input_only[i] - round(r * self._kept[i + 1]) for i in range(n)]
        )
        # new_grad_upto[b]: the last layer <= b whose backward makes a new input gradient.
        last = -1
        self._new_grad_upto = []
        for i, layer in enumerate(layers):
            last = last if layer.reuses_grad else i
            self._new_grad_upto.append(last)

    def _build_storages(self, prof: Profile, n: int) -> None:
        saved, freed, small = [0] * n, [0] * n, [0] * n
        entering = [0] * (n + 2)  # difference array: bytes entering layer a (its input)
        self._unsaved_out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self._kept_out = [0] * n  # saved by layer b and part of its output: lives on
        # Where a layer's input is freed in a backward: at its first saver, if before the layer.
        input_saver = list(range(n))
        for s in prof.storages:
            if s.first_saver is not None and s.creator >= 0 and s.last_output is not None:
                for j in range(s.creator + 1, min(s.last_output + 1, n - 1) + 1):
                    input_saver[j] = min(input_saver[j], s.first_saver)
            if s.saved and s.creator >= 0:
                saved[s.creator] += s.nbytes
                if s.nbytes * self.scale < MIN_BYTES:  # offload leaves it on the device
                    small[s.creator] += s.nbytes
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
        self._small = _prefix(small)
        self._freed = _prefix(freed)
        # The direct products' saved inputs, at the layer whose backward would free them.
        self._saved_at = [0] * n
        for j, layer in enumerate(prof.layers):
            self._saved_at[j] += layer.direct_saved_bytes - layer.direct_saved_input_bytes
            self._saved_at[input_saver[j]] += layer.direct_saved_input_bytes
        self._input = list(accumulate(entering))[: n + 1]

    # -- figures ------------------------------------------------------------------------------
    def held(self, a: int, b: int) -> tuple[int, int, int]:
        """(whole, checkpointed, offloaded) bytes one whole-batch "micro-batch" keeps on stage
        a..b: everything; its input; what offload leaves: its input and output, and saved
        tensors too small to send (a micro-batch's share under ``MIN_BYTES``)."""
        stage_input = self._input[a]
        inside = self._saved[b + 1] - self._saved[a]
        output = sum(nbytes for creator, nbytes in self._unsaved_out[b] if creator >= a)
        out, small = self._out[b], self._small[b + 1] - self._small[a]
        away = stage_input + min(out + small, inside + output)
        return stage_input + inside + output, stage_input, away

    def figures(self, a: int, b: int) -> Figures:
        """The figures of a stage holding layers ``a..b`` (inclusive), per micro-batch (made
        once per range: a search asks for each range on every stage it may be)."""
        found = self._figures.get((a, b))
        if found is None:
            found = self._figures[a, b] = self._figures_of(a, b)
        return found

    def _figures_of(self, a: int, b: int) -> Figures:
        r = self.scale
        whole, inputs, away = (round(x * r) for x in self.held(a, b))
        grads = self._g[b + 1] - self._g[a]
        incoming = round(r * self._out[b])
        batch = 0
        if a == 0:  # views of the resident batch; the input needs no gradient
            batch, whole, away, inputs = self._input[0], whole - inputs, away - inputs, 0
        in_grad = inputs if a > 0 else 0
        kept = round(r * (self._kept[b + 1] - self._kept[a]))
        if a == 0:
            waits, split_b = whole + incoming, 0  # B does nothing; W is the whole backward
        elif self._generic[b + 1] > self._generic[a]:  # W needs autograd: B keeps the graph
            waits, split_b = whole + kept, self._input_grad(a, b, kept + in_grad, incoming)
        else:
            waits = kept + round(r * (self._saved_direct[b + 1] - self._saved_direct[a]))
            split_b = self._sweep(self._freeing, a, b)
        transient = {
            "forward": round(self._fwd(a, b) * r),
            "backward": self._sweep(self._new, a, b),
            "backward_end": in_grad + incoming + grads,
            "input_grad": split_b,
            # Stage 0's W is its whole backward; the incoming gradient is held in ``waits``.
            "weight": grads if a > 0 else self._sweep(self._new, a, b) - incoming,
        }
        summed = dict(transient, weight=grads - (self._direct[b + 1] - self._direct[a]))
        if self._large[b + 1] > self._large[a]:  # an unsplit backward is direct too
            new = grads - (self._whole_direct[b + 1] - self._whole_direct[a])
            summed["backward"] = self._sweep(self._summed, a, b)
            summed["backward_end"] = in_grad + incoming + new
            if a == 0:
                summed["weight"] = summed["backward"] - incoming
        elif a == 0:
            summed["weight"] = transient["weight"]
        return Figures(
            params=self._p[b + 1] - self._p[a],
            grads=grads,
            optimizer=self._o[b + 1] - self._o[a],
            batch=batch,
            whole=whole,
            inputs=inputs,
            waits=waits,
            away=away,
            output=incoming,
            splits=self._unsplit[b + 1] == self._unsplit[a],
            transient=transient,
            summed=summed,
            step_loop=self._step_loop(a, b),
            step_multi=self._step_multi[b + 1] - self._step_multi[a],
        )

    def _sweep(self, sweep: _Sweep, a: int, b: int) -> int:
        """Peak of one micro-batch's backward beyond what the stage holds for it (scaled to a
        micro-batch, except gradients): with :attr:`_new`, a whole backward with the parameter
        gradients it creates.

        The last layer's backward starts with everything held. When layer i < b runs, the
        gradient that arrived for the stage's output is still alive (the engine holds it),
        what layers i+1..b were the first to save is already freed (unless it is the stage's
        output, which the engine also holds), layers i+1..b have made their gradients and
        layer i makes its own while it frees what it saved (its profiled points).
        """
        last = sweep.own[b]
        if a == b:
            return last
        tail = self._freed[b + 1] - self._kept_out[b]
        # Layers after q only hand the stage's incoming gradient on (in place, views): for
        # layers from q on, that gradient is their own incoming one, already in their figure.
        q = max(self._new_grad_upto[b], a)
        best = last
        held_out = self._out[b]
        if sweep is self._freeing and self._keeps_incoming[b]:
            held_out = 0  # the engine's incoming gradient is the one kept for W: in ``left``
        for lo, hi, table, extra in (
            (a, q - 1, sweep.inner, held_out),
            (q, b - 1, sweep.outer, 0),
        ):
            if lo <= hi:
                rest = round(self.scale * (extra - tail))
                best = max(best, table(lo, hi) + rest + sweep.left[b + 1])
        return best

    def _input_grad(self, a: int, b: int, end: int, incoming: int) -> int:
        """Peak of B of a split backward beyond the micro-batch's activations: when layer i
        runs, its own gradients (incoming, intermediate, its input's), what layers i+1..b
        recorded for W, and the stage's incoming gradient (alive throughout; in the figure
        of layer b, or kept for W). At the end: all recorded, and the input gradient."""
        unkept = 0 if self._keeps_incoming[b] else incoming
        best = max(end + unkept, self._input_only[b])
        if a < b:
            tail = self._input_only_tail(a, b - 1) + round(self.scale * self._kept[b + 1])
            best = max(best, tail + unkept)
        return best

    def static_bytes(self, a: int, b: int) -> int:
        """Parameters + gradients + optimizer state of layers a..b (a lower bound of the peak)."""
        return (
            self._p[b + 1] - self._p[a] + self._g[b + 1] - self._g[a] + self._o[b + 1] - self._o[a]
        )

    # -- peaks --------------------------------------------------------------------------------
    def stage(self, j: int, a: int, b: int) -> StageMemory:
        """Predicted peak of stage ``j`` holding layers ``a..b`` (inclusive), counting only
        stage ``j``'s own part of every moment of its worker.

        With one stage per device that is the device's peak. With several, it bounds the
        stage's part from above: the device's peak is at most the sum of its stages' (the
        planner's feasibility test) and exactly :meth:`device`.
        """
        w = self.schedule.placement[j]
        own = [s if s == j else None for s in self.schedule.stages_of(w)]
        return self._peak(w, [(a, b) if s is not None else None for s in own])[own.index(j)]

    def device(self, w: int, ranges: Sequence[tuple[int, int]]) -> list[StageMemory]:
        """The exact peak of worker ``w`` whose stages (``stages_of(w)`` order) hold layers
        ``ranges``; one :class:`StageMemory` per stage, summing to the device's peak."""
        return self._peak(w, list(ranges))

    def _peak(self, w: int, ranges: list[tuple[int, int] | None]) -> list[StageMemory]:
        figs = [self.figures(*r) if r is not None else None for r in ranges]
        splits = tuple(f.splits if f is not None else True for f in figs)
        best, top = None, -1
        for m in self._moments(w, splits):
            total = self._total(m, figs, w)
            if total > top:
                best, top = m, total
        assert best is not None  # the optimizer moment is always there
        return self._attribute(best, figs, top, w)

    def _moments(self, w: int, splits: tuple[bool, ...]) -> Sequence[Moment]:
        key = (w, splits)
        if key not in self._walked:  # a few per worker: the walk is O(M) and queries O(1)
            offload = self.offload is not None
            found = worker_moments(self.schedule, w, self.checkpoint, splits, offload)
            self._walked[key] = found
        return self._walked[key]

    def _total(self, m: Moment, figs: list[Figures | None], w: int) -> int:
        total = 0
        for at, f in enumerate(figs):
            if f is not None:
                total += f.params + f.optimizer + f.held(m, at) + (f.grads if m.sums[at] else 0)
        return total + sum(self._posted(m, figs, w).values()) + self._transient(m, figs, w)

    def _posted(self, m: Moment, figs: list[Figures | None], w: int) -> dict[int, int]:
        """Per stage position of worker ``w``, the bytes of the receives it has posted at
        ``m`` (none in one process)."""
        if self.posted is None:
            return {}
        out = {}
        for at, f in enumerate(figs):
            if f is not None:
                edges = [(f.inputs, f.output) if k == at else None for k in range(len(figs))]
                out[at] = self.posted.bytes(w, m, edges)
        return out

    def _transient(self, m: Moment, figs: list[Figures | None], w: int) -> int:
        present = [f for f in figs if f is not None]
        if m.kind == "optimizer":
            if self.foreach[w]:
                return sum(f.step_multi for f in present)
            return max((f.step_loop for f in present), default=0)
        f = figs[m.acting]
        if f is None:
            return 0
        return (f.summed if m.sums[m.acting] else f.transient)[m.kind]

    def _attribute(
        self, m: Moment, figs: list[Figures | None], peak: int, w: int
    ) -> list[StageMemory]:
        """Split the device's peak into per-stage parts: each stage's static bytes and what it
        holds (its receives posted ahead with it); the rest is transient (the acting stage's).
        Before a stage's gradients all exist (a first backward), the peak can be less than the
        static bytes plus what was held when the backward began: what it had freed comes off
        the activations."""
        stages = self.schedule.stages_of(w)
        present = [(at, f) for at, f in enumerate(figs) if f is not None]
        posted = self._posted(m, figs, w)
        act = {at: f.held(m, at) + posted.get(at, 0) for at, f in present}
        static = sum(f.params + f.grads + f.optimizer for _, f in present)
        rest = peak - static - sum(act.values())
        order = sorted(act, key=lambda at: at != m.acting)  # take from the acting stage first
        for at in order:
            cut = min(act[at], max(0, -rest))
            act[at], rest = act[at] - cut, rest + cut
        out = []
        for at, f in enumerate(figs):
            if f is None:
                out.append(StageMemory(0, 0, 0, 0, 0, 0, 0, m.kind))
                continue
            share = rest if at == (m.acting if m.acting >= 0 else present[0][0]) else 0
            parts = (f.params, f.grads, f.optimizer, act[at], share)
            out.append(StageMemory(*parts, sum(parts), self._in_flight[stages[at]], m.kind))
        return out
