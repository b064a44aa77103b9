"""One backward pass of a stage, handed to autograd's engine without the Python around it.

``torch.autograd.grad`` checks its arguments in Python before it calls the engine: every
output and input tested for a tensor or a gradient edge and for torch-function overrides, every
gradient's shape and kind against its output's, the arguments packed into tuples. On a stage of
a few small layers those checks cost as much as the backward's own arithmetic, once per B and
per W of every micro-batch. The passes of :mod:`pipepar.core.step` and
:mod:`pipepar.core.split_backward` are plain: tensor outputs with one gradient tensor of the
same shape each, tensors or gradient edges as inputs, unused inputs allowed. :func:`grad` checks
exactly that (a comparison of shapes per output) and calls the engine as
``torch.autograd.grad`` does (its configuration kept for the engine's threads, logging hooks
when its logger asks for them); anything else (a tensor subclass, an active torch-function
mode, a shape that differs, a complex gradient of a real output) goes through
``torch.autograd.grad`` itself, which dispatches the override or raises its own error. The
engine checks each gradient's dtype and device itself in both cases, and computes the same
gradients: only the Python before it differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import has_torch_function

__all__ = ["grad"]

_Engine = Callable[..., tuple[Tensor | None, ...]]
_ENGINE: _Engine | None = getattr(torch.autograd.graph, "_engine_run_backward", None)
"""What ``torch.autograd.grad`` calls (torch >= 2.3); without it, every pass goes through
``torch.autograd.grad``."""


def grad(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor | GradientEdge],
    grads: Sequence[Tensor],
    *,
    retain_graph: bool = False,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=..., allow_unused=True)``.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> x = torch.ones(2, requires_grad=True)
        >>> grad([w * x], [x, w], [torch.full((2,), 3.0)])
        (tensor([3., 3.]), tensor([3., 3.]))
    """
    try:
        if _ENGINE is not None and _plain(outputs, inputs, grads):
            return _ENGINE(
                tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs), True, False
            )
        mixed: Any = inputs  # tensors and gradient edges together, which its types do not list
        return torch.autograd.grad(
            outputs, mixed, grads, retain_graph=retain_graph, allow_unused=True
        )
    except RuntimeError as error:
        if _ASKS_OF_A_LEAF in str(error):
            raise RuntimeError(_LEAF_ASKED) from error
        raise


_ASKS_OF_A_LEAF = "_will_engine_execute_node"
_LEAF_ASKED = (
    "a hook on a stage's input asked autograd whether its engine will reach a leaf, which "
    "torch cannot answer while a stage's backward computes the gradients of chosen inputs "
    "(torch's module tracker asks it of every module's inputs: FlopCounterMode and the memory "
    "tracker use it). The stages of an nn.Sequential are handed values with a history; a "
    "model cut while it runs hands its units leaves. Use such a tool on the plain model, or "
    "on an nn.Sequential of the model's blocks"
)


def _plain(outputs: Sequence[Any], inputs: Sequence[Any], grads: Sequence[Any]) -> bool:
    """Whether ``torch.autograd.grad`` would pass these to the engine as they are."""
    if not inputs or len(outputs) != len(grads):
        return False
    for t, g in zip(outputs, grads):
        if not (isinstance(t, Tensor) and isinstance(g, Tensor)) or t.shape != g.shape:
            return False
        if t.is_complex() != g.is_complex() or t.is_nested:
            return False
    tensors = []
    for t in inputs:
        if isinstance(t, Tensor):
            tensors.append(t)
        elif not isinstance(t, GradientEdge):
            return False
    return not has_torch_function((*outputs, *tensors))
