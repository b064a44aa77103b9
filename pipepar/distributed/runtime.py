"""Execute this rank's list of schedule actions for one mini-batch.

Scheduling (what to run) comes from :mod:`pipepar.schedule`, transport (how bytes move) from
:mod:`pipepar.distributed.transport`; this module only walks the local actions in order:

* ``F(i)``: take micro-batch ``i``'s input (a chunk of ``x`` on stage 0, else the activation
  received from stage j-1), run the stage, hand the output to stage j+1 (or compute the loss
  on the last stage).
* ``B(i)``: take the gradient of the output (from stage j+1, or the scaled loss on the last
  stage), back-propagate through the stage on this thread, hand the input gradient to j-1.

Receives are posted one action ahead (while ``F(i)`` computes, ``F(i+1)``'s activation can
arrive), once the shapes of the mini-batch are known from an earlier one with the same input
signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipepar.core.recompute import recomputing, should_checkpoint
from pipepar.core.schedule import Schedule
from pipepar.distributed.mesh import Mesh
from pipepar.distributed.transport import Incoming, TensorMeta, Transport

__all__ = ["LossFn", "Runtime"]

LossFn = Callable[[Any, Tensor], Tensor]


@dataclass
class _Shapes:
    """Per micro-batch metadata of the stage's inputs and outputs for one input signature."""

    inputs: list[tuple[TensorMeta, ...]]
    outputs: list[tuple[TensorMeta, ...]]


@dataclass
class _Step:
    """Everything one mini-batch holds while it runs."""

    m: int
    shapes: _Shapes | None  # None on the first mini-batch of a signature
    chunks: Sequence[Tensor] = ()
    targets: Sequence[Tensor] = ()
    inputs: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    outputs: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    losses: dict[int, Tensor] = field(default_factory=dict)
    in_metas: dict[int, tuple[TensorMeta, ...]] = field(default_factory=dict)
    out_metas: dict[int, tuple[TensorMeta, ...]] = field(default_factory=dict)
    posted_act: dict[int, Incoming] = field(default_factory=dict)
    posted_grad: dict[int, Incoming] = field(default_factory=dict)
    loss_sum: Tensor | None = None


class Runtime:
    """Runs the local stage's part of a :class:`~pipepar.schedule.Schedule`.

    Args:
        module: the local stage.
        mesh: this rank's grid position.
        transport: its sends and receives.
        schedule: the whole pipeline's schedule; this rank runs ``schedule.stage(mesh.stage)``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        before_last_backward: called right before the stage's last backward of a mini-batch
            (after it, every gradient is final), e.g. to start averaging gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        transport: Transport,
        schedule: Schedule,
        checkpoint: str,
        *,
        before_last_backward: Callable[[], None] | None = None,
    ) -> None:
        self.module, self.mesh, self.transport = module, mesh, transport
        self.before_last_backward = before_last_backward
        self.m = schedule.n_microbatches
        self.actions = schedule.stage(mesh.stage)
        self.checkpoint = checkpoint
        self.first, self.last = mesh.stage == 0, mesh.stage == mesh.pp - 1
        self._fwd_order = [a.microbatch for a in self.actions if a.kind == "F"]
        self._bwd_order = [a.microbatch for a in self.actions if a.kind == "B"]
        self._fwd_pos = {i: k for k, i in enumerate(self._fwd_order)}
        self._bwd_pos = {i: k for k, i in enumerate(self._bwd_order)}
        self._shapes: dict[int, _Shapes] = {}
        self._signatures: dict[tuple[Any, ...], int] = {}
        self.doing: str | None = None
        """What the stage runs now, e.g. ``"backward of micro-batch 2"``, for error reports."""

    def run(self, x: Tensor | None, target: Tensor | None, loss_fn: LossFn) -> Tensor | None:
        """Run one mini-batch; return the sum of the micro-batch losses on the last stage."""
        self.doing = None
        signature = self.transport.exchange_header(self._signature(x) if self.first else None)
        st = _Step(self.m, self._shapes.get(signature))
        if self.first:
            st.chunks = _split(x, self.m, "x")
        if self.last:
            st.targets = _split(target, self.m, "target")
        self._prefetch(st, "F", 0)
        self._prefetch(st, "B", 0)
        last_b = self._bwd_order[-1]
        for action in self.actions:
            if action.kind == "F":
                self.doing = f"forward of micro-batch {action.microbatch}"
                self._forward(st, action.microbatch, loss_fn)
                continue
            if action.microbatch == last_b and self.before_last_backward is not None:
                self.before_last_backward()
            self.doing = f"backward of micro-batch {action.microbatch}"
            self._backward(st, action.microbatch)
        self.doing = "last sends of the mini-batch"
        self.transport.flush()
        self.doing = None
        if st.shapes is None:
            self._remember(signature, st)
        return st.loss_sum

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, st: _Step, i: int, loss_fn: LossFn) -> None:
        inputs = (st.chunks[i],) if self.first else self._receive_input(st, i)
        output = self._run_stage(inputs, i)
        outputs = (output,) if isinstance(output, Tensor) else tuple(output)
        st.inputs[i], st.outputs[i] = inputs, outputs
        st.out_metas[i] = tuple(TensorMeta.of(t) for t in outputs)
        if self.last:
            self.doing = f"loss_fn of micro-batch {i}"
            loss = loss_fn(output, st.targets[i])
            st.losses[i] = loss
            detached = loss.detach()
            st.loss_sum = detached if st.loss_sum is None else st.loss_sum + detached
        else:
            if st.shapes is not None:
                self._check_outputs(i, st.out_metas[i], st.shapes.outputs[i])
            self.transport.send_activation(i, outputs, with_meta=st.shapes is None)

    def _check_outputs(
        self, i: int, metas: tuple[TensorMeta, ...], expected: tuple[TensorMeta, ...]
    ) -> None:
        """Refuse to send an output the next stage has no buffer for (gloo would abort on it)."""
        if metas != expected:
            raise ValueError(
                f"stage {self.mesh.stage} output of micro-batch {i} is {_show(metas)} but was "
                f"{_show(expected)} on an earlier mini-batch with the same input shape; the next "
                "stage receives into buffers sized from that earlier mini-batch, so a stage's "
                "output shapes and dtypes must depend only on its input's (pad variable-size "
                "outputs to a fixed size)"
            )

    def _receive_input(self, st: _Step, i: int) -> tuple[Tensor, ...]:
        metas = st.shapes.inputs[i] if st.shapes else self.transport.recv_meta()
        incoming = st.posted_act.pop(i, None) or self.transport.post_activation(i, metas)
        self._prefetch(st, "F", self._fwd_pos[i] + 1)
        buffers = self.transport.take(incoming)
        st.in_metas[i] = metas
        return tuple(b.requires_grad_(m.requires_grad) for b, m in zip(buffers, metas, strict=True))

    def _run_stage(self, inputs: tuple[Tensor, ...], i: int) -> Any:
        def run(*tensors: Tensor) -> Any:
            return self.module(tensors[0] if len(tensors) == 1 else tensors)

        if torch.is_grad_enabled() and should_checkpoint(self.checkpoint, i, self.m):
            layers = list(self.module.children())
            return checkpoint(
                run,
                *inputs,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), recomputing(layers)),
            )
        return run(*inputs)

    # -- backward -----------------------------------------------------------------------------
    def _backward(self, st: _Step, i: int) -> None:
        inputs, outputs = st.inputs.pop(i), st.outputs.pop(i)
        if self.last:
            (st.losses.pop(i) / self.m).backward()
        else:
            grads = self._receive_grad(st, i)
            needing = [t for t in outputs if t.requires_grad]
            if needing:
                torch.autograd.backward(needing, list(grads))
            self.transport.release_activation(i)
        if not self.first:
            grads_in = [_grad_or_zeros(t) for t in inputs if t.requires_grad]
            self.transport.send_grad(i, grads_in)

    def _receive_grad(self, st: _Step, i: int) -> tuple[Tensor, ...]:
        incoming = st.posted_grad.pop(i, None)
        if incoming is None:
            incoming = self.transport.post_grad(i, _grad_metas(st.out_metas[i]))
        self._prefetch(st, "B", self._bwd_pos[i] + 1)
        return self.transport.take(incoming)

    # -- early receives -----------------------------------------------------------------------
    def _prefetch(self, st: _Step, kind: str, position: int) -> None:
        """Post the receive of the ``position``-th F (or B) of this stage, if shapes are known."""
        if kind == "F":
            if self.first or position >= len(self._fwd_order) or st.shapes is None:
                return
            i = self._fwd_order[position]
            st.posted_act[i] = self.transport.post_activation(i, st.shapes.inputs[i])
        else:
            if self.last or position >= len(self._bwd_order):
                return
            i = self._bwd_order[position]
            metas = st.out_metas.get(i) or (st.shapes.outputs[i] if st.shapes else None)
            if metas is not None:
                st.posted_grad[i] = self.transport.post_grad(i, _grad_metas(metas))

    # -- signatures and shapes ----------------------------------------------------------------
    def _signature(self, x: Tensor | None) -> int:
        if not isinstance(x, Tensor):
            raise TypeError(
                f"x must be the mini-batch tensor on stage 0, but got {type(x).__name__}; pass "
                "the input batch to pipe.step(x, target, loss_fn) on the first stage's ranks"
            )
        key = (tuple(x.shape), x.dtype, x.device.type)
        return self._signatures.setdefault(key, len(self._signatures))

    def _remember(self, signature: int, st: _Step) -> None:
        inputs = [st.in_metas.get(i, ()) for i in range(self.m)]
        self._shapes[signature] = _Shapes(inputs, [st.out_metas[i] for i in range(self.m)])


def _show(metas: Sequence[TensorMeta]) -> str:
    shown = [
        f"{m.shape} {str(m.dtype).removeprefix('torch.')}{'' if m.requires_grad else ' (no grad)'}"
        for m in metas
    ]
    return shown[0] if len(shown) == 1 else f"({', '.join(shown)})"


def _grad_metas(metas: Sequence[TensorMeta]) -> list[TensorMeta]:
    return [m for m in metas if m.requires_grad]


def _grad_or_zeros(t: Tensor) -> Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _split(value: Tensor | None, m: int, name: str) -> list[Tensor]:
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
    return list(value.tensor_split(m))
