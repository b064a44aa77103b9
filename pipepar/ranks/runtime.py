"""The rank executor: run this rank's list of schedule actions for one mini-batch.

Scheduling (what to run) comes from :mod:`pipepar.core.schedule`, computing each action from
:mod:`pipepar.core.step` (the same step the threads of one process use), the walk over the
rank's actions from :mod:`pipepar.core.executor` and the moving of values between this rank's
stages and its peers from :mod:`pipepar.ranks.carrier` (over :mod:`pipepar.ranks.transport`).
This module prepares a mini-batch: every rank agrees on what it runs (the header), the batch
and target are split, the steps made with their loss head, and a stage's final gradients go to
``.grad`` and the replicas' all-reduce (``on_final``) while the other actions still run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipepar.core.executor import walk
from pipepar.core.losses import Items, LossFn, LossShares, loss_shares
from pipepar.core.microbatch import Value, scatter
from pipepar.core.offload_plan import offloader_for
from pipepar.core.randomness import Recorded
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.core.step import StageStep
from pipepar.ranks.carrier import ChainCarrier, Shapes, final_positions, next_of_kind
from pipepar.ranks.measured_placement import MeasuredPlacement
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.transport import Transport

__all__ = ["Runtime"]
OnFinal = Callable[[list[torch.nn.Parameter], bool], None]
"""``on_final(params, overlapped)``: a stage's gradients are final (``overlapped``: the rank has
actions left to run)."""


class Runtime:
    """Runs this rank's part of a :class:`~pipepar.core.schedule.Schedule`.

    Args:
        stages: this rank's stages (``schedule.stages_of(mesh.stage)``), on its device.
        mesh: this rank's grid position.
        transport: its sends and receives.
        schedule: the whole pipeline's schedule.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        recompute: ``"in_place"`` or ``"bubbles"``: where recomputes run
            (:mod:`pipepar.core.recompute_placement`). With ``"bubbles"`` and ``asked``, each
            batch's are placed on unit costs until a training mini-batch (the second) has
            timed the stages, then on those times, shared by every rank of the grid
            (:mod:`pipepar.ranks.measured_placement`).
        on_final: called with a stage's parameters once their gradients for the mini-batch
            are in ``.grad`` (e.g. to start averaging them over the replicas), and whether the
            rank has actions left to run meanwhile.
        offload: whether saved activations go to host memory between F and B
            (:mod:`pipepar.core.offload_plan`).
        asked: ``schedule`` as asked, before its recomputes were placed (None: ``schedule``,
            run as it is, rebuilt for a batch of fewer micro-batches).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        mesh: Mesh,
        transport: Transport,
        schedule: Schedule,
        checkpoint: str,
        *,
        recompute: str = "in_place",
        on_final: OnFinal | None = None,
        offload: bool = False,
        asked: Schedule | None = None,
    ) -> None:
        self.stages = {s.index: s for s in stages}
        self.offload = offload
        self.mesh, self.transport, self.schedule = mesh, transport, schedule
        self.checkpoint, self.on_final = checkpoint, on_final
        self.recompute = recompute
        self.chunks, self.last = schedule.n_microbatches, schedule.n_stages - 1
        self._placement = MeasuredPlacement(
            schedule, asked, recompute, checkpoint, self.stages, mesh, transport.device
        )
        self._use(schedule)
        self._shapes: dict[int, Shapes] = {}
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
        carrier = self._walk(x, None, None, None, None, False)
        return [carrier.outputs[i] for i in range(self.m)] if self.last in self.stages else None

    def _walk(
        self,
        x: Value | list[Tensor] | None,
        target: Tensor | list[Tensor] | None,
        loss_fn: LossFn | None,
        items: Items | None,
        spread: Callable[[LossShares], LossShares] | None,
        grad: bool,
    ) -> ChainCarrier:
        """This rank's actions of one mini-batch (the forward ones only without ``grad``); the
        carrier keeps what the mini-batch gave (the loss, or the last stage's outputs)."""
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
        placed = self._placement.placed(m)  # fewer rows than chunks: fewer micro-batches
        if placed is not self.schedule:
            self._use(placed)
        known = self._shapes.get(signature)
        self._shares: Sequence[float] = []
        self._seeds: Sequence[float] = []
        steps = self._steps(target, loss_fn, items, spread, grad)
        chunks = _split(x, self.m, "x") if 0 in self.stages else ()
        carrier = ChainCarrier(
            mesh=self.mesh,
            transport=self.transport,
            placement=self.schedule.placement,
            steps=steps,
            known=known,
            chunks=chunks,
            shares=self._shares,
            seeds=self._seeds,
            finals=self._finals if grad else {},
            following=self._next,
            deliver=self._deliver,
        )
        # Without a backward the forwards alone keep their order: each waits only on forwards.
        actions = self.actions if grad else [a for a in self.actions if a.kind == "F"]
        walk(actions, steps, carrier)
        carrier.finish(len(actions))
        self.mesh.progress.begin("end of the mini-batch")
        if known is None:
            self._shapes[signature] = carrier.seen
        self._placement.ran(grad)  # after the timed batch: placed again on the shared times
        return carrier

    @property
    def full(self) -> Schedule:
        """The schedule of a full mini-batch (``chunks`` micro-batches), as every rank runs
        it (its recomputes placed on the stages' times once they are shared)."""
        return self._placement.full

    def _use(self, schedule: Schedule) -> None:
        """Run ``schedule`` (the pipe's, or one for fewer micro-batches) from now on."""
        self.schedule, self.m = schedule, schedule.n_microbatches
        self.actions = schedule.worker(self.mesh.stage)
        self._finals = final_positions(self.actions)
        self._next = next_of_kind(self.actions)

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

        training = any(layer.training for s in self.stages.values() for layer in s.layers)
        offloader = offloader_for(
            self.offload and grad and training, self.schedule, self.stages.values()
        )
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
                offload=offloader,
                record=self._placement.recorder(grad),
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


def _add_grad(p: Tensor, g: Tensor) -> None:
    with torch.no_grad():
        if p.grad is None:
            p.grad = g if g.stride() == p.stride() else g.contiguous()
        else:
            p.grad.add_(g)


_CALLS = ("a training step", "an evaluation", "a forward")
"""What a mini-batch runs: every rank of the pipeline must run the same (checked)."""


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
