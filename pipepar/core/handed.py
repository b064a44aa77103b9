"""What a stage's code is handed of a leaf its backward asks for: a view with a history.

A stage's backward asks autograd for the gradients of its inputs, which the step makes leaves
(detached from the stage before, or received from another rank). Tools that hook a module's
inputs for the backward (torch's module tracker, which ``FlopCounterMode`` and the memory
tracker use) ask autograd whether its engine will reach each one; autograd cannot answer that
for a leaf while the engine computes the gradients of chosen inputs (``RuntimeError: A leaf
node was passed to _will_engine_execute_node``), and the plain model's backward never asks
it: there every module but the first is handed a value with a history. So a stage's code is
handed a view of each such leaf, made with autograd recording, and the backward asks for the
view's gradient (the leaf's, computed without running the view's own backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipepar.core.grad_mode import GradMode

__all__ = ["handed", "leaf_under"]


def handed(leaf: Tensor) -> Tensor:
    """A view of ``leaf`` with a history if it is a leaf that takes a gradient (of torch's own
    tensor type: a subclass keeps its leaf); else ``leaf``.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> with torch.no_grad():
        ...     v = handed(x)
        >>> v.is_leaf, v.requires_grad, v.grad_fn.name()
        (False, True, 'ViewBackward0')
    """
    if not leaf.requires_grad or leaf.grad_fn is not None or type(leaf) is not Tensor:
        return leaf
    with torch._C.DisableTorchFunction(), GradMode(True):
        return leaf.view_as(leaf)


def leaf_under(t: Tensor) -> Tensor:
    """The leaf a :func:`handed` view stands on (what the graph's accumulator holds); ``t``
    itself if it is no view.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> leaf_under(handed(x)) is x, leaf_under(x) is x
        (True, True)
    """
    base = t._base
    return t if base is None else base
