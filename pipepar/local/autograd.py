"""The autograd node of ``pipe.step`` for both computes of a pipe of one process (a chain of
layers, a model's program), and :func:`unalias` for any custom function returning what it was
given."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["BACKWARD_TWICE", "StepFunction", "unalias"]

BACKWARD_TWICE = (
    "pipepar: a second backward through the same pipe output (loss.backward(retain_graph=True), "
    "then another backward through that call's output) is not supported: the pipe frees every "
    "stage's graph in the first backward, whatever retain_graph says. Add the losses computed "
    "from one call and call backward() once, or call the pipe again for the second loss"
)
"""The error of a second backward through one call's output (``pipe(...)``)."""


class StepFunction(torch.autograd.Function):
    """The autograd node of ``pipe.step``: forward runs the whole schedule (F, B and W) by
    calling ``step_all()``, which returns the joined loss; backward hands the gradients ``run``
    found (of ``args``: each micro-batch's tensors, then the parameters) to autograd, scaled by the
    loss's gradient."""

    @staticmethod
    def forward(ctx: Any, step_all: Callable[[], Tensor], run: Any, *args: Tensor) -> Any:
        loss = step_all()
        ctx.grads = [*run.microbatch_input_grads(), *run.take_param_grads()]
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        grads, ctx.grads = ctx.grads, None
        scale = None if bool((grad == 1).all()) else grad
        scaled = [g if g is None or scale is None else g * scale.to(g.device) for g in grads]
        return (None, None, *scaled)


def unalias(t: Tensor, inputs: Sequence[Tensor]) -> Tensor:
    """``t``, or a copy where it is one of ``inputs``: autograd forbids a custom function
    returning one of its inputs as an output."""
    return t.clone() if any(t is x or t.data_ptr() == x.data_ptr() for x in inputs) else t
