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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["hooks_set_aside"]


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
