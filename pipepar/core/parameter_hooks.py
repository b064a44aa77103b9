"""Hooks registered on the parameters (``p.register_hook(fn)``) see each parameter's whole
gradient once per backward, as on the plain model.

On the plain model autograd sums every use of a parameter in a backward and calls its hooks
once, with that sum, before it is added into ``.grad``. A pipe computes the same gradient in
pieces: each stage's backward passes run autograd on one micro-batch's graph, whose leaves are
the model's own parameters, so autograd would call the parameter's hooks there, once per
micro-batch, with that micro-batch's share; the sums are then handed to autograd through the
pipe's node, which calls the hooks once more. A hook that is not linear (clamping, clipping
per parameter) or that counts or logs would give other numbers than the plain model's.

While a pipe runs backward actions, :func:`hooks_set_aside` empties each parameter's hook
table in place (autograd keeps a reference to the table itself) and puts the entries back, in
their order and under their handles' ids, when the actions are done: the hooks then run once,
on the sums, when the pipe's node hands them to autograd. Hooks the pipe adds to a parameter
for its own sums (:meth:`pipepar.core.step.StageStep._summing`) come and go inside the actions.

Across ranks no autograd node hands the sums over: a rank writes ``.grad`` itself
(:mod:`pipepar.program.rank_compute`), so it runs the hooks on each final sum with
:func:`through_hooks` (before the replicas' all-reduce, as a hook runs before
``DistributedDataParallel``'s reduction) and, once the sum is in ``.grad``, the hooks
registered with ``register_post_accumulate_grad_hook`` with :func:`after_accumulation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["after_accumulation", "hooks_set_aside", "through_hooks"]


@contextlib.contextmanager
def hooks_set_aside(params: Iterable[Tensor]) -> Iterator[None]:
    """Inside: no hook registered on ``params`` runs; after: each table as it was, followed
    by any hook registered inside and not removed."""
    kept: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    for p in params:
        table = p._backward_hooks
        if table:
            kept.append((table, list(table.items())))
            table.clear()
    try:
        yield
    finally:
        for table, entries in kept:
            added = list(table.items())
            table.clear()
            table.update(entries)
            table.update(added)


def through_hooks(p: Tensor, grad: Tensor) -> Tensor:
    """``grad``, ``p``'s whole gradient, through ``p``'s hooks in their order, as autograd
    runs them: a hook's result, where it returns one, replaces the gradient."""
    for hook in list((p._backward_hooks or {}).values()):
        result = hook(grad)
        if result is not None:
            grad = result
    return grad


def after_accumulation(p: Tensor) -> None:
    """Run ``p``'s post-accumulate-grad hooks, its gradient now in ``.grad``."""
    for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
        hook(p)
