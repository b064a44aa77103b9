"""The autograd node standing for a whole pipe of any model (``pipe(...)`` then ``backward()``).

Its forward runs every micro-batch's forward through the stages and returns the tensors of the
joined output; its backward hands each micro-batch its part of the output gradient, runs the
stages' backward actions and returns the gradients of the call's tensors and the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from pipepar.local.autograd import unalias as _unalias
from pipepar.local.executor import BACKWARD, FORWARD
from pipepar.program import caches
from pipepar.program.calls import join
from pipepar.program.losses import ModelLoss
from pipepar.program.run import ProgramRun

if TYPE_CHECKING:
    from pipepar.local.pipe_view import PipeView

__all__ = ["ProgramFunction", "as_tuple"]


class ProgramFunction(torch.autograd.Function):
    """The autograd node standing for the whole pipe: inputs are the call's tensors and the
    parameters, outputs the tensors of the model's output."""

    @staticmethod
    def forward(
        ctx: Any,
        pipe: PipeView,
        run: ProgramRun,
        holder: dict[str, Any],
        shares: ModelLoss | None,
        n: int,
        *args: Tensor,
    ) -> Any:
        run.execute(pipe._workers(), FORWARD)
        results = run.results()
        by_leaf = _leaf_shares(results, shares)
        leaves, spec = pytree.tree_flatten(join(results, run.rows, by_leaf))
        holder["spec"], holder["leaves"] = spec, leaves
        caches.detach_caches(leaves)  # no gradient flows through a returned key-value cache
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        ctx.pipe, ctx.run, ctx.n = pipe, run, n
        ctx.results = [pytree.tree_leaves(r) for r in results]
        ctx.weights = _tensor_weights(ctx.results[0], run.rows, by_leaf)
        outs = tuple(_unalias(t.detach(), args) for t in tensors)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        holder["n"] = len(leaves)
        holder["positions"] = [k for k, t in enumerate(leaves) if isinstance(t, Tensor)]
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        run: ProgramRun | None = ctx.run
        ctx.run = None
        if run is None:
            raise RuntimeError("pipepar: backward through a pipe output twice is not supported")
        _seed(run, ctx.results, grads, run.rows, ctx.weights)
        run.open_backward()
        # on CUDA this runs on the autograd engine's device thread: the stage workers'
        # backwards would queue behind it there, so the pipe runs them on this thread instead
        run.execute(ctx.pipe._workers(backward=True), BACKWARD)
        return (None, None, None, None, None, *run.input_grads(), *run.take_param_grads())


def joined(results: list[Any], rows: list[int], shares: ModelLoss | None) -> Any:
    """The micro-batches' outputs joined; each value reduced over the batch by its shares."""
    return join(results, rows, _leaf_shares(results, shares))


def _leaf_shares(results: list[Any], shares: ModelLoss | None) -> dict[int, Sequence[float]]:
    if shares is None or not results:
        return {}
    shares.learn_output(results[0])
    return dict(shares.leaf_shares())


def _tensor_weights(
    leaves: list[Any], rows: list[int], by_leaf: dict[int, Sequence[float]]
) -> list[list[float]]:
    """Per tensor leaf of the output, each micro-batch's share of a one-value leaf's gradient:
    by rows, or a reduced value's shares."""
    total = sum(rows)
    by_rows = [r / total for r in rows]
    return [
        list(by_leaf[k]) if k in by_leaf else by_rows
        for k, t in enumerate(leaves)
        if isinstance(t, Tensor)
    ]
def _seed(
    run: ProgramRun,
    results: list[list[Any]],
    grads: Sequence[Tensor | None],
    rows: list[int],
    weights: list[list[float]],
) -> None:
    """Hand each micro-batch the part of the output gradient that is its own."""
    per_mb_tensors = [[t for t in leaves if isinstance(t, Tensor)] for leaves in results]
    for k, g in enumerate(grads):
        if g is None:
            continue
        for i, ts in enumerate(per_mb_tensors):
            t = ts[k]
            if t.dim() > 0 and g.dim() > 0 and len(per_mb_tensors) > 1:
                part = g.split(rows)[i]
            elif len(per_mb_tensors) > 1:
                if weights[k][i] == 0:
                    continue  # a loss over no label: nothing to differentiate
                part = (g * weights[k][i]).reshape(t.shape)
            else:
                part = g
            run.seed(i, t, part)


def as_tuple(outs: Any) -> tuple[Any, ...]:
    return outs if isinstance(outs, tuple) else (outs,)
