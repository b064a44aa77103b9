"""The rank executor: run this rank's list of schedule actions for one mini-batch.

Scheduling (what to run) comes from :mod:`pipepar.core.schedule`, computing each action from
:mod:`pipepar.core.step` (the same step the threads of one process use), transport (how bytes
move) from :mod:`pipepar.ranks.transport`. This module only walks the rank's actions in
order and moves values:

* ``F(s, i)``: take stage ``s``'s input of micro-batch ``i`` (a chunk of ``x`` on stage 0, the
  output of stage ``s-1`` handed over on this rank, or received from its rank), run the step,
  and hand the output to stage ``s+1`` (on the last stage, the step's head is the loss).
* ``B(s, i)``: take the gradient of the output (on the last stage, the micro-batch's share of
  the loss), run the step, hand the input gradient to stage ``s-1``.
* ``W(s, i)``: the deferred parameter gradients.

Once a stage's last backward action of the mini-batch is done, its parameter gradients are
final: they go to ``.grad`` and to the replicas' all-reduce while the other actions still run.
Receives are posted one action ahead (while ``F(i)`` computes, ``F(i+1)``'s activation can
arrive), once the shapes of the mini-batch are known from an earlier one with the same input
signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipepar.core.losses import Items, LossFn, LossShares, loss_shares
from pipepar.core.microbatch import Value, scatter, tensors
from pipepar.core.named_schedules import NAMES, make
from pipepar.core.randomness import Recorded
from pipepar.core.schedule import Action, Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.progress import describe
from pipepar.ranks.transport import Incoming, TensorMeta, Transport

__all__ = ["Runtime", "fewer_microbatches"]
Metas = tuple[TensorMeta, ...]
OnFinal = Callable[[list[torch.nn.Parameter], bool], None]
"""``on_final(params, overlapped)``: a stage's gradients are final (``overlapped``: the rank has
actions left to run)."""


@dataclass
class _Shapes:
    """Per (stage, micro-batch) metadata of received inputs and of outputs, for one signature."""

    inputs: dict[tuple[int, int], Metas] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Metas] = field(default_factory=dict)


@dataclass
class _Batch:
    """Everything one mini-batch holds while it runs."""

    shapes: _Shapes | None  # None on the first mini-batch of a signature
    seen: _Shapes
    steps: dict[int, StageStep]
    chunks: Sequence[Value] = ()
    local: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    posted: dict[tuple[str, int, int], Incoming] = field(default_factory=dict)
    loss_sum: Tensor | None = None
    outputs: dict[int, Value] = field(default_factory=dict)  # the last stage's, with no loss


class Runtime:
    """Runs this rank's part of a :class:`~pipepar.core.schedule.Schedule`.

    Args:
        stages: this rank's stages (``schedule.stages_of(mesh.stage)``), on its device.
        mesh: this rank's grid position.
        transport: its sends and receives.
        schedule: the whole pipeline's schedule.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        on_final: called with a stage's parameters once their gradients for the mini-batch
            are in ``.grad`` (e.g. to start averaging them over the replicas), and whether the
            rank has actions left to run meanwhile.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        mesh: Mesh,
        transport: Transport,
        schedule: Schedule,
        checkpoint: str,
        *,
        on_final: OnFinal | None = None,
    ) -> None:
        self.stages = {s.index: s for s in stages}
        self.mesh, self.transport, self.schedule = mesh, transport, schedule
        self.checkpoint, self.on_final = checkpoint, on_final
        self.chunks, self.last = schedule.n_microbatches, schedule.n_stages - 1
        self._full = schedule
        self._use(schedule)
        self._shapes: dict[int, _Shapes] = {}
        self._signatures: dict[tuple[Any, ...], int] = {}

    @property
    def doing(self) -> str | None:
        """What the rank runs now, e.g. ``"backward of micro-batch 2"``, for error reports
        (kept by the mesh's :class:`~pipepar.ranks.progress.Progress`)."""
        return self.mesh.progress.doing

    @doing.setter
    def doing(self, doing: str | None) -> None:
        self.mesh.progress.doing = doing

    def run(
        self,
        x: Value | list[Tensor] | None,
        target: Tensor | list[Tensor] | None,
        loss_fn: LossFn,
        *,
        items: Items | None = None,
        spread: Callable[[LossShares], LossShares] | None = None,
        grad: bool = True,
    ) -> Tensor | None:
        """Run one mini-batch; on the last stage return its loss: the micro-batch losses
        times their shares (:mod:`pipepar.core.losses`; ``spread`` makes them shares of the
        batch of every replica, and may scale their backward seeds). With ``grad=False``
        (evaluation) only the forward actions run, and the steps keep nothing for a backward.
        ``x`` and ``target`` are the batch and its target (split into ``chunks``), or lists
        of the micro-batches the caller made and their targets (run as they are)."""
        return self._walk(x, target, loss_fn, items, spread, grad).loss_sum

    def forward(self, x: Value | None) -> list[Value] | None:
        """The forward actions only, with no loss: on the last stage's rank, that stage's
        output of each micro-batch; None on the other ranks."""
        batch = self._walk(x, None, None, None, None, False)
        return [batch.outputs[i] for i in range(self.m)] if self.last in self.stages else None

    def _walk(
        self,
        x: Value | list[Tensor] | None,
        target: Tensor | list[Tensor] | None,
        loss_fn: LossFn | None,
        items: Items | None,
        spread: Callable[[LossShares], LossShares] | None,
        grad: bool,
    ) -> _Batch:
        """This rank's actions of one mini-batch (the forward ones only without ``grad``)."""
        self.mesh.progress.begin("start of the mini-batch")
        self._reported: set[int] = set()  # parameters whose final gradient went out
        first = 0 in self.stages
        call = 0 if grad else 1 if loss_fn is not None else 2
        signature, m, theirs = self.transport.exchange_header(
            self._signature(x) if first else None, self._microbatches(x) if first else 0, call
        )
        if theirs != call:
            raise ValueError(
                f"this rank was called for {_CALLS[call]} but the rank of stage 0 for "
                f"{_CALLS[theirs]}; every rank of a pipeline must make the same call (to "
                "evaluate, call pipe.step(...) under torch.no_grad() on every rank)"
            )
        if m != self.m:  # a batch with fewer rows than chunks runs fewer micro-batches
            self._use(fewer_microbatches(self._full, m))
        known = self._shapes.get(signature)
        self._shares: Sequence[float] = []
        self._seeds: Sequence[float] = []
        batch = _Batch(known, _Shapes(), self._steps(target, loss_fn, items, spread, grad))
        if 0 in self.stages:
            batch.chunks = _split(x, self.m, "x")
        # Without a backward the forwards alone keep their order: each waits only on forwards.
        actions = self.actions if grad else [a for a in self.actions if a.kind == "F"]
        for k, action in enumerate(actions):
            self.mesh.progress.begin(describe(action, several=len(self.stages) > 1))
            self._act(batch, action)
            if grad and k in self._finals:
                self._deliver(batch.steps[action.stage], k < len(self.actions) - 1)
        self.mesh.progress.begin("last sends of the mini-batch")
        self.transport.flush()
        self.mesh.progress.begin("end of the mini-batch")
        if known is None:
            self._shapes[signature] = batch.seen
        return batch

    def _use(self, schedule: Schedule) -> None:
        """Run ``schedule`` (the pipe's, or one for fewer micro-batches) from now on."""
        self.schedule, self.m = schedule, schedule.n_microbatches
        self.actions = schedule.worker(self.mesh.stage)
        self._finals = _last_backward_positions(self.actions)
        self._next = _next_of_kind(self.actions)

    def _microbatches(self, x: Any) -> int:
        """``chunks``, or the rows of a smaller batch (one micro-batch per row); as many as
        the caller made."""
        if isinstance(x, list):
            return len(x)
        rows = x.shape[0] if isinstance(x, Tensor) and x.dim() > 0 else 0
        if rows == 0:
            raise ValueError(
                f"x has no rows (shape {tuple(x.shape) if isinstance(x, Tensor) else None}); "
                "pass a batch with at least one sample on dimension 0"
            )
        return min(self.chunks, rows)

    def _steps(
        self,
        target: Tensor | list[Tensor] | None,
        loss_fn: LossFn | None,
        items: Items | None,
        spread: Callable[[LossShares], LossShares] | None,
        grad: bool,
    ) -> dict[int, StageStep]:
        head = None
        if self.last in self.stages and loss_fn is not None:
            targets: list[Any] = _split(target, self.m, "target")
            shares = loss_shares(loss_fn, targets, [len(t) for t in targets], items)
            shares = spread(shares) if spread is not None else shares
            self._shares, head = shares.weights, shares.head_of(loss_fn, targets)
            self._seeds = shares.seeds
        randomness = Recorded()  # one thread runs this rank's stages, in schedule order

        def loss(output: Any, i: int) -> Tensor:
            doing, self.doing = self.doing, f"loss_fn of micro-batch {i}"
            value = head(output, i)  # type: ignore[misc]
            self.doing = doing
            return value

        return {
            s: StageStep(
                stage,
                self.m,
                checkpoint=self.checkpoint,
                grad=grad,
                input_grad=s > 0,
                streams=randomness,
                split=functools.partial(self.schedule.splits_backward, s),
                head=loss if s == self.last and head is not None else None,
                on_final=functools.partial(self._param_final, stage),
            )
            for s, stage in self.stages.items()
        }

    def _param_final(self, stage: Stage, k: int, grad: Tensor) -> None:
        """One parameter's gradient is final while its stage's last backward still runs:
        into ``.grad``, and to the replica sync (its bucket may go out now)."""
        p = stage.trainable()[k]
        _add_grad(p, grad)
        self._reported.add(id(p))
        if self.on_final is not None:
            self.on_final([p], True)

    # -- one action -----------------------------------------------------------------------------
    def _act(self, batch: _Batch, action: Action) -> None:
        s, i = action.stage, action.microbatch
        step = batch.steps[s]
        if action.kind == "W":
            step.weight(i)
        elif action.kind == "F":
            x = batch.chunks[i] if s == 0 else self._input(batch, s, i)
            self._output(batch, s, i, step.forward(i, x))
        else:
            grads = self._grads(batch, s, i)
            grads_in = step.backward(i, grads)
            if s > 0:
                self._send_back(batch, s, i, grads_in)
            if s < self.last and self._rank_of(s + 1) != self.mesh.stage:
                self.transport.release_activation(s + 1, i)

    def _output(self, batch: _Batch, s: int, i: int, y: Any) -> None:
        outputs = tensors(y)
        batch.seen.outputs[(s, i)] = tuple(_meta(t) for t in outputs)
        if s == self.last and batch.steps[s].head is None:  # forward only: the output itself
            batch.outputs[i] = y
        elif s == self.last:
            loss = outputs[0].detach() * self._shares[i]
            batch.loss_sum = loss if batch.loss_sum is None else batch.loss_sum + loss
        elif self._rank_of(s + 1) == self.mesh.stage:
            batch.local[("F", s + 1, i)] = y
        else:
            if batch.shapes is not None:
                self._check_outputs(s, i, batch.seen.outputs[(s, i)], batch.shapes.outputs[(s, i)])
            metas = batch.seen.outputs[(s, i)] if batch.shapes is None else None
            self.transport.send_activation(
                i, outputs, dst=self._peer(s + 1), stage=s + 1, metas=metas
            )

    def _input(self, batch: _Batch, s: int, i: int) -> Any:
        if self._rank_of(s - 1) == self.mesh.stage:
            return batch.local.pop(("F", s, i))
        src = self._peer(s - 1)
        if batch.shapes is not None:
            metas = batch.shapes.inputs[(s, i)]
        else:
            metas = self.transport.recv_meta(src=src, stage=s)
        incoming = batch.posted.pop(("F", s, i), None) or self.transport.post_activation(
            i, metas, src=src, stage=s
        )
        self._prefetch(batch, "F", s, i)
        batch.seen.inputs[(s, i)] = metas
        received = self.transport.take(incoming)
        return received[0] if len(received) == 1 else received

    def _grads(self, batch: _Batch, s: int, i: int) -> tuple[Tensor | None, ...]:
        if s == self.last:
            return (torch.tensor(self._seeds[i], device=self.stages[s].device),)
        if self._rank_of(s + 1) == self.mesh.stage:
            return batch.local.pop(("B", s, i))
        metas = batch.seen.outputs[(s, i)]
        incoming = batch.posted.pop(("B", s, i), None) or self.transport.post_grad(
            i, _grad_metas(metas), src=self._peer(s + 1), stage=s
        )
        self._prefetch(batch, "B", s, i)
        it = iter(self.transport.take(incoming))
        return tuple(next(it) if m.requires_grad else None for m in metas)

    def _send_back(self, batch: _Batch, s: int, i: int, grads_in: Sequence[Tensor | None]) -> None:
        if self._rank_of(s - 1) == self.mesh.stage:
            batch.local[("B", s - 1, i)] = tuple(grads_in)
            return
        metas = batch.seen.inputs[(s, i)]
        sent = [
            g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=self._device(s))
            for g, m in zip(grads_in, metas)
            if m.requires_grad
        ]
        self.transport.send_grad(i, sent, dst=self._peer(s - 1), stage=s - 1)

    def _deliver(self, step: StageStep, overlapped: bool) -> None:
        """Add a stage's final gradient sums into ``.grad``; tell the replica sync."""
        for p, g in zip(step.params, step.param_grads()):
            if g is not None:
                _add_grad(p, g)
        step.release()
        left = [p for p in step.params if id(p) not in self._reported]
        self._reported.update(id(p) for p in left)
        if self.on_final is not None:
            self.on_final(left, overlapped)

    # -- early receives -------------------------------------------------------------------------
    def _prefetch(self, batch: _Batch, kind: str, s: int, i: int) -> None:
        """Post the receive of stage ``s``'s next ``kind`` action, if its shapes are known."""
        nxt = self._next.get((kind, s, i))
        if nxt is None or batch.shapes is None:
            return
        if kind == "F":
            metas = batch.shapes.inputs[(s, nxt)]
            batch.posted[("F", s, nxt)] = self.transport.post_activation(
                nxt, metas, src=self._peer(s - 1), stage=s
            )
        else:
            metas = batch.seen.outputs.get((s, nxt)) or batch.shapes.outputs[(s, nxt)]
            batch.posted[("B", s, nxt)] = self.transport.post_grad(
                nxt, _grad_metas(metas), src=self._peer(s + 1), stage=s
            )

    # -- placement ------------------------------------------------------------------------------
    def _rank_of(self, stage: int) -> int:
        """Pipeline position (worker) of ``stage``."""
        return self.schedule.placement[stage]

    def _peer(self, stage: int) -> int:
        """Global rank of the rank holding ``stage`` in this replica."""
        return self.mesh.pipeline_ranks[self._rank_of(stage)]

    def _device(self, stage: int) -> torch.device:
        return self.stages[stage].device

    # -- signatures and shapes ------------------------------------------------------------------
    def _signature(self, x: Value | list[Tensor] | None) -> int:
        """The kind of mini-batch: its shape, or each given micro-batch's (the shapes of every
        stage's values are learned per kind, micro-batch by micro-batch)."""
        if not isinstance(x, (Tensor, list)):
            raise TypeError(
                f"x must be the mini-batch tensor on stage 0, but got {type(x).__name__}; pass "
                "the input batch to pipe.step(x, target, loss_fn) (or pipe(x)) on the first "
                "stage's ranks"
            )
        xs = _given(x, "microbatches") if isinstance(x, list) else [x]
        key = tuple((tuple(t.shape), t.dtype, t.device.type) for t in xs)
        return self._signatures.setdefault((isinstance(x, list), key), len(self._signatures))

    def _check_outputs(self, s: int, i: int, metas: Metas, expected: Metas) -> None:
        """Refuse to send an output the next stage has no buffer for (gloo would abort on it)."""
        if metas != expected:
            raise ValueError(
                f"stage {s} output of micro-batch {i} is {_show(metas)} but was "
                f"{_show(expected)} on an earlier mini-batch with the same input shape; the next "
                "stage receives into buffers sized from that earlier mini-batch, so a stage's "
                "output shapes and dtypes must depend only on its input's (pad variable-size "
                "outputs to a fixed size)"
            )


def _add_grad(p: Tensor, g: Tensor) -> None:
    with torch.no_grad():
        if p.grad is None:
            p.grad = g if g.stride() == p.stride() else g.contiguous()
        else:
            p.grad.add_(g)


def _meta(t: Tensor) -> TensorMeta:
    """What the receiver needs; floating-point outputs get a gradient back."""
    return TensorMeta(tuple(t.shape), t.dtype, t.is_floating_point())


def _last_backward_positions(actions: Sequence[Action]) -> set[int]:
    """Positions of each stage's last backward action (B or W) of the mini-batch."""
    last: dict[int, int] = {}
    for k, a in enumerate(actions):
        if a.kind != "F":
            last[a.stage] = k
    return set(last.values())


def _next_of_kind(actions: Sequence[Action]) -> dict[tuple[str, int, int], int]:
    """For (kind, stage, micro-batch), the micro-batch of that stage's next action of the kind."""
    following: dict[tuple[str, int, int], int] = {}
    previous: dict[tuple[str, int], int] = {}
    for a in actions:
        if a.kind == "W":
            continue
        key = (a.kind, a.stage)
        if key in previous:
            following[(a.kind, a.stage, previous[key])] = a.microbatch
        previous[key] = a.microbatch
    return following


def _show(metas: Sequence[TensorMeta]) -> str:
    shown = [
        f"{m.shape} {str(m.dtype).removeprefix('torch.')}{'' if m.requires_grad else ' (no grad)'}"
        for m in metas
    ]
    return shown[0] if len(shown) == 1 else f"({', '.join(shown)})"


def _grad_metas(metas: Sequence[TensorMeta]) -> list[TensorMeta]:
    return [m for m in metas if m.requires_grad]


_CALLS = ("a training step", "an evaluation", "a forward")
"""What a mini-batch runs: every rank of the pipeline must run the same (checked)."""


@functools.lru_cache(maxsize=16)
def fewer_microbatches(schedule: Schedule, m: int) -> Schedule:
    """``schedule`` rebuilt for ``m`` micro-batches (a batch with fewer rows than chunks)."""
    if m == schedule.n_microbatches:
        return schedule
    if schedule.name not in NAMES:
        raise ValueError(
            f"the batch gives {m} micro-batches but the schedule object was built for "
            f"{schedule.n_microbatches}; pass at least {schedule.n_microbatches} rows (or "
            f"{schedule.n_microbatches} microbatches=), or a schedule by name (which is "
            "rebuilt for each batch's count)"
        )
    return make(schedule.name, schedule.n_stages, m, n_workers=schedule.n_workers)


def _given(values: list[Any], name: str) -> list[Tensor]:
    """Micro-batches (or targets) the caller made: one tensor each, with rows."""
    for i, t in enumerate(values):
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] == 0:
            shown = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(
                f"{name}[{i}] is {shown}, but a pipe of an nn.Sequential across ranks takes one "
                f"tensor with at least one row per micro-batch; pass {name}=[tensor, ...]"
            )
    return values


def _split(value: Value | list[Tensor] | None, m: int, name: str) -> list[Value]:
    if isinstance(value, list):  # micro-batches the caller made: as they are
        if len(value) != m:
            raise ValueError(
                f"{name} has {len(value)} micro-batches but stage 0's rank passed {m}; pass "
                "the same lists (microbatches=, targets=) on every rank of the pipeline"
            )
        return list(_given(value, name))
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{name} must be a Tensor on this stage, but got {type(value).__name__}; stage 0 needs "
            "x and the last stage needs target (other stages may pass None)"
        )
    if value.dim() == 0 or value.shape[0] < m:
        rows = value.shape[0] if value.dim() else 0
        raise ValueError(
            f"{name} has {rows} rows but chunks={m}; pass at least {m} rows or lower chunks"
        )
    return scatter(value, m)  # as the one-process pipe splits: the schedule needs all m
