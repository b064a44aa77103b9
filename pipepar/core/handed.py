"""What a stage's layers are handed of the leaf its backward asks for: a view with a history.

A stage's backward asks autograd for the gradients of its input, which the step makes a leaf
(detached from the stage before). Tools that hook a module's inputs for the backward (torch's
module tracker, which ``FlopCounterMode`` and the memory tracker use) ask autograd whether its
engine will reach each one; autograd cannot answer that for a leaf while the engine computes
the gradients of chosen inputs (``RuntimeError: A leaf node was passed to
_will_engine_execute_node``), and the plain model's backward never asks it: there every layer
but the first is handed a value with a history. So a stage's layers are handed a view of such
a leaf, made with autograd recording (a checkpointed forward's too), and the backward still
asks for the leaf's gradient (the view's backward passes it on unchanged).
"""

from __future__ import annotations

from torch import Tensor

from pipepar.core.grad_mode import GradMode

__all__ = ["handed"]


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
    with GradMode(True):  # a view made without would be a leaf that autograd cannot follow
        return leaf.view_as(leaf)
