"""How a chain's values move for one rank's walk of its actions (the ranks' carrier).

:func:`pipepar.core.executor.walk` runs the rank's list of actions through
:class:`~pipepar.core.step.StageStep` (the compute); :class:`ChainCarrier` says where each
action's values come from and go, for one mini-batch:

* ``F(s, i)`` takes a chunk of ``x`` on stage 0, the output of stage ``s-1`` handed over on
  this rank, or receives it from its rank; its output goes to stage ``s+1`` the same ways (on
  the last stage, the step's head is the loss, summed here times its share);
* ``B(s, i)`` takes the gradient of the output (on the last stage, the micro-batch's share of
  the loss, the seed) and hands the input gradient back to stage ``s-1``;
* ``W(s, i)`` needs nothing from elsewhere.

The shapes of what a rank receives are learned on the first mini-batch of an input signature
(sent ahead of the values) and reused after: receives are then posted one action ahead (while
``F(i)`` computes, ``F(i+1)``'s activation can arrive). Once the walk moves past a stage's last
backward action of the mini-batch, its parameter gradients are final and go out
(``deliver``), while the other actions still run. Every action is reported to the mesh's
:class:`~pipepar.ranks.progress.Progress` before it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipepar.core.microbatch import Value, tensors
from pipepar.core.schedule import Action
from pipepar.core.step import StageStep
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.progress import describe
from pipepar.ranks.transport import Incoming, TensorMeta, Transport

__all__ = ["ChainCarrier", "Shapes", "final_positions", "next_of_kind"]
Metas = tuple[TensorMeta, ...]


@dataclass
class Shapes:
    """Per (stage, micro-batch) metadata of received inputs and of outputs, for one signature."""

    inputs: dict[tuple[int, int], Metas] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Metas] = field(default_factory=dict)


class ChainCarrier:
    """The values of one mini-batch on this rank, between its stages and to its peers.

    Args:
        mesh: this rank's grid position (its peers, its progress).
        transport: its sends and receives.
        placement: the pipeline position (worker) of every stage.
        steps: this rank's stages' steps.
        known: the shapes learned on an earlier mini-batch of this signature (None: the
            first one, whose shapes are sent ahead and kept in :attr:`seen`).
        chunks: stage 0's micro-batches (on its rank).
        shares: each micro-batch loss's share of the batch's (on the last stage's rank).
        seeds: each micro-batch's backward seed (on the last stage's rank).
        finals: by position in the walked list, the stage whose last backward action it is.
        following: for (kind, stage, micro-batch), the micro-batch of the stage's next
            action of that kind (what to receive ahead).
        deliver: called with a stage's step once its gradients are final, and whether the
            rank has actions left to run.
    """

    def __init__(
        self,
        *,
        mesh: Mesh,
        transport: Transport,
        placement: Sequence[int],
        steps: Mapping[int, StageStep],
        known: Shapes | None,
        chunks: Sequence[Value],
        shares: Sequence[float],
        seeds: Sequence[float],
        finals: Mapping[int, int],
        following: Mapping[tuple[str, int, int], int],
        deliver: Callable[[StageStep, bool], None],
    ) -> None:
        self.mesh, self.transport, self.placement = mesh, transport, placement
        self.steps, self.known, self.chunks = steps, known, chunks
        self.shares, self.seeds = shares, seeds
        self.finals, self.following, self.deliver = finals, following, deliver
        self.last = len(placement) - 1
        self.seen = Shapes()
        self.loss_sum: Tensor | None = None
        self.outputs: dict[int, Value] = {}  # the last stage's, with no loss
        self._local: dict[tuple[str, int, int], Any] = {}
        self._posted: dict[tuple[str, int, int], Incoming] = {}
        self._several = len(steps) > 1
        self._begin = mesh.progress.begin

    def finish(self, n: int) -> None:
        """After the walk of ``n`` actions: the last stage's gradients out, the sends done."""
        self._final(n - 1, overlapped=False)
        self._begin("last sends of the mini-batch")
        self.transport.flush()

    # -- the carrier seam (pipepar.core.executor.Carrier) ---------------------------------------
    def begin(self, k: int, action: Action) -> None:
        """Deliver the gradients the previous action made final; report this action."""
        if k - 1 in self.finals:
            self._final(k - 1, overlapped=True)
        self._begin(describe(action, several=self._several))

    def take_forward(self, k: int, action: Action) -> Any:
        s, i = action.stage, action.microbatch
        if s == 0:
            return self.chunks[i]
        if self._mine(s - 1):
            return self._local.pop(("F", s, i))
        src = self._peer(s - 1)
        if self.known is not None:
            metas = self.known.inputs[(s, i)]
        else:
            metas = self.transport.recv_meta(src=src, stage=s)
        incoming = self._posted.pop(("F", s, i), None) or self.transport.post_activation(
            i, metas, src=src, stage=s
        )
        self._ahead("F", s, i)
        self.seen.inputs[(s, i)] = metas
        received = self.transport.take(incoming)
        return received[0] if len(received) == 1 else received

    def give_forward(self, k: int, action: Action, y: Any) -> None:
        s, i = action.stage, action.microbatch
        outputs = tensors(y)
        metas = self.seen.outputs[(s, i)] = tuple(_meta(t) for t in outputs)
        if s == self.last and self.steps[s].head is None:  # forward only: the output itself
            self.outputs[i] = y
        elif s == self.last:
            loss = outputs[0].detach() * self.shares[i]
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        elif self._mine(s + 1):
            self._local[("F", s + 1, i)] = y
        else:
            if self.known is not None:
                _check_outputs(s, i, metas, self.known.outputs[(s, i)])
            ahead = metas if self.known is None else None  # the first time: shapes ahead
            self.transport.send_activation(
                i, outputs, dst=self._peer(s + 1), stage=s + 1, metas=ahead
            )

    def take_backward(self, k: int, action: Action) -> tuple[Tensor | None, ...]:
        s, i = action.stage, action.microbatch
        if s == self.last:
            return (torch.scalar_tensor(self.seeds[i], device=self.steps[s].stage.device),)
        if self._mine(s + 1):
            return self._local.pop(("B", s, i))  # type: ignore[no-any-return]
        metas = self.seen.outputs[(s, i)]
        incoming = self._posted.pop(("B", s, i), None) or self.transport.post_grad(
            i, _grad_metas(metas), src=self._peer(s + 1), stage=s
        )
        self._ahead("B", s, i)
        it = iter(self.transport.take(incoming))
        return tuple(next(it) if m.requires_grad else None for m in metas)

    def give_backward(self, k: int, action: Action, grads: Any) -> None:
        s, i = action.stage, action.microbatch
        if s > 0:
            self._send_back(s, i, grads)
        if s < self.last and not self._mine(s + 1):
            self.transport.release_activation(s + 1, i)

    def claim_weight(self, k: int, action: Action) -> bool:
        return True

    def release_weight(self, k: int, action: Action) -> None:
        pass

    def failed(self, action: Action, error: BaseException) -> None:
        """Nothing to add: the pipe reports the failure with this rank's progress."""

    # -- moving values --------------------------------------------------------------------------
    def _send_back(self, s: int, i: int, grads_in: Sequence[Tensor | None]) -> None:
        if self._mine(s - 1):
            self._local[("B", s - 1, i)] = tuple(grads_in)
            return
        metas = self.seen.inputs[(s, i)]
        device = self.steps[s].stage.device
        sent = [
            g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=device)
            for g, m in zip(grads_in, metas)
            if m.requires_grad
        ]
        self.transport.send_grad(i, sent, dst=self._peer(s - 1), stage=s - 1)

    def _ahead(self, kind: str, s: int, i: int) -> None:
        """Post the receive of stage ``s``'s next ``kind`` action, if its shapes are known."""
        nxt = self.following.get((kind, s, i))
        if nxt is None or self.known is None:
            return
        if kind == "F":
            metas = self.known.inputs[(s, nxt)]
            self._posted[("F", s, nxt)] = self.transport.post_activation(
                nxt, metas, src=self._peer(s - 1), stage=s
            )
        else:
            metas = self.seen.outputs.get((s, nxt)) or self.known.outputs[(s, nxt)]
            self._posted[("B", s, nxt)] = self.transport.post_grad(
                nxt, _grad_metas(metas), src=self._peer(s + 1), stage=s
            )

    def _final(self, k: int, *, overlapped: bool) -> None:
        stage = self.finals.get(k)
        if stage is not None:
            self.deliver(self.steps[stage], overlapped)

    # -- placement ------------------------------------------------------------------------------
    def _mine(self, stage: int) -> bool:
        """Whether ``stage`` runs on this rank."""
        return self.placement[stage] == self.mesh.stage

    def _peer(self, stage: int) -> int:
        """Global rank of the rank holding ``stage`` in this replica."""
        return self.mesh.pipeline_ranks[self.placement[stage]]


def final_positions(actions: Sequence[Action]) -> dict[int, int]:
    """Each stage's last backward action (B or W) of the mini-batch: its position -> stage."""
    last: dict[int, int] = {}
    for k, a in enumerate(actions):
        if a.kind != "F":
            last[a.stage] = k
    return {k: s for s, k in last.items()}


def next_of_kind(actions: Sequence[Action]) -> dict[tuple[str, int, int], int]:
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


def _check_outputs(s: int, i: int, metas: Metas, expected: Metas) -> None:
    """Refuse to send an output the next stage has no buffer for (gloo would abort on it)."""
    if metas != expected:
        raise ValueError(
            f"stage {s} output of micro-batch {i} is {_show(metas)} but was "
            f"{_show(expected)} on an earlier mini-batch with the same input shape; the next "
            "stage receives into buffers sized from that earlier mini-batch, so a stage's "
            "output shapes and dtypes must depend only on its input's (pad variable-size "
            "outputs to a fixed size)"
        )


def _meta(t: Tensor) -> TensorMeta:
    """What the receiver needs; floating-point outputs get a gradient back."""
    return TensorMeta(tuple(t.shape), t.dtype, t.is_floating_point())


def _show(metas: Sequence[TensorMeta]) -> str:
    shown = [
        f"{m.shape} {str(m.dtype).removeprefix('torch.')}{'' if m.requires_grad else ' (no grad)'}"
        for m in metas
    ]
    return shown[0] if len(shown) == 1 else f"({', '.join(shown)})"


def _grad_metas(metas: Sequence[TensorMeta]) -> list[TensorMeta]:
    return [m for m in metas if m.requires_grad]
