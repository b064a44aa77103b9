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

from pipepar.batching import caches
from pipepar.batching.calls import Parts
from pipepar.batching.joins import LeafJoin, join, join_with
from pipepar.batching.packed_inputs import aligned
from pipepar.local.autograd import BACKWARD_TWICE
from pipepar.local.autograd import unalias as _unalias
from pipepar.local.executor import BACKWARD, FORWARD
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
        pipe.execute(run, FORWARD)
        results = aligned(run.results())
        by_leaf = _leaf_shares(results, shares)
        output, ways = join_with(results, run.parts, by_leaf)
        leaves, spec = pytree.tree_flatten(output)
        holder["spec"], holder["leaves"] = spec, leaves
        caches.detach_caches(leaves)  # no gradient flows through a returned key-value cache
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        ctx.pipe, ctx.run, ctx.n = pipe, run, n
        ctx.results = [pytree.tree_leaves(r) for r in results]
        ctx.ways = [w for w, t in zip(ways, ctx.results[0]) if isinstance(t, Tensor)]
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
            raise RuntimeError(BACKWARD_TWICE)
        _seed(run, ctx.results, grads, ctx.ways)
        run.open_backward()
        # on CUDA this runs on the autograd engine's device thread: the stage workers'
        # backwards would queue behind it there, so the pipe runs them on this thread instead
        ctx.pipe.execute(run, BACKWARD, backward=True)
        return (None, None, None, None, None, *run.input_grads(), *run.take_param_grads())


def joined(results: list[Any], parts: Parts | list[int], shares: ModelLoss | None) -> Any:
    """The micro-batches' outputs joined; each value reduced over the batch by its shares."""
    results = aligned(results)
    return join(results, parts, _leaf_shares(results, shares))


def _leaf_shares(results: list[Any], shares: ModelLoss | None) -> dict[int, Sequence[float]]:
    if shares is None or not results:
        return {}
    shares.learn_output(results[0])
    return dict(shares.leaf_shares())


def _seed(
    run: ProgramRun,
    results: list[list[Any]],
    grads: Sequence[Tensor | None],
    ways: list[LeafJoin],
) -> None:
    """Hand each micro-batch the part of the output gradient that is its own, by how its
    output was joined."""
    per_mb_tensors = [[t for t in leaves if isinstance(t, Tensor)] for leaves in results]
    for k, g in enumerate(grads):
        if g is None:
            continue
        column = [ts[k] for ts in per_mb_tensors]
        for i, part in enumerate(_parts_of_grad(ways[k], column, g)):
            if part is not None:
                run.seed(i, column[i], part)


def _parts_of_grad(way: LeafJoin, column: list[Tensor], g: Tensor) -> list[Tensor | None]:
    """Each micro-batch's part of the gradient of a joined leaf (None: it adds nothing)."""
    if way.kind == "concat":
        return list(g.split(list(way.sizes), dim=way.dim))
    if way.kind == "shares":
        return [None if w == 0 else (g * w).reshape(t.shape) for t, w in zip(column, way.weights)]
    if way.kind == "sum" or way.kind == "single":
        return [g.reshape(t.shape) for t in column]
    if way.kind == "custom":
        pieces = [t.detach().requires_grad_(t.is_floating_point()) for t in column]
        with torch.enable_grad():
            out = way.custom(pieces)
            wanted = [p for p in pieces if p.requires_grad]
            got = iter(torch.autograd.grad(out, wanted, g, allow_unused=True))
        return [next(got) if p.requires_grad else None for p in pieces]
    return [None for _ in column]


def as_tuple(outs: Any) -> tuple[Any, ...]:
    return outs if isinstance(outs, tuple) else (outs,)
