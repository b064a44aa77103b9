"""Split a mini-batch into micro-batches and join the outputs back.

A *value* flowing between layers is a tensor or a tuple of tensors; every tensor carries the
batch on dimension 0. Micro-batch ``i`` of ``m`` is a view of rows of the mini-batch, so
splitting costs no copy; joining the last stage's outputs concatenates them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

Value = Tensor | tuple[Tensor, ...]

__all__ = ["Value", "check_rows", "check_value", "gather", "map_tensors", "scatter", "tensors"]


def tensors(value: Value) -> tuple[Tensor, ...]:
    """The tensors of a value, as a tuple (a lone tensor becomes a 1-tuple)."""
    return (value,) if isinstance(value, Tensor) else value


def map_tensors(value: Value, fn: Callable[[Tensor], Tensor]) -> Value:
    """Apply ``fn`` to every tensor of a value, keeping its shape (tensor or tuple)."""
    if isinstance(value, Tensor):
        return fn(value)
    return tuple(fn(t) for t in value)


def check_value(value: object, *, what: str) -> Value:
    """Return ``value`` if it is a tensor or a non-empty tuple of tensors, else raise TypeError.

    Args:
        value: what a caller passed in or a layer returned.
        what: how to name it in the error, e.g. ``"input"`` or ``"output of layer 3 (ReLU)"``.
    """
    if isinstance(value, Tensor):
        return value
    if isinstance(value, tuple) and value and all(isinstance(t, Tensor) for t in value):
        return value
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(t).__name__ for t in value) or "empty"
        kind = f"{kind} of ({kinds})"
    raise TypeError(
        f"{what} must be a Tensor or a tuple of Tensors, but got {kind}; "
        "wrap other values in a tensor or keep them inside one layer"
    )


def check_rows(value: Value, rows: int, what: Callable[[], str]) -> None:
    """Raise ValueError unless every tensor of ``value`` has ``rows`` rows on dimension 0.

    A stage's output is the next stage's micro-batch, or a row block of the joined output; one
    without the batch on dimension 0 would end in a cryptic error of ``torch.cat``, or worse,
    join the micro-batches wrongly.

    Args:
        value: what a stage returned.
        rows: the rows of the micro-batch it ran on.
        what: names who returned ``value`` in the message, e.g. ``"layer 3 (Flatten)"``;
            called only on failure, so a passing check costs one shape comparison per tensor.
    """
    for t in tensors(value):
        if t.dim() == 0 or t.shape[0] != rows:
            break
    else:
        return
    shapes = [tuple(t.shape) for t in tensors(value)]
    shown = shapes[0] if isinstance(value, Tensor) else shapes
    raise ValueError(
        f"{what()} returned shape {shown} for a micro-batch of {rows} rows; a pipe splits and "
        f"joins the batch on dimension 0, so every stage must return it there ({rows} rows "
        "here). Keep the batch on dimension 0; reduce the output after the pipe "
        "(pipe(x).sum()) or in a loss with pipe.step(x, target, loss_fn); or change balance "
        "so that the stage ends where the batch is on dimension 0"
    )


def _batch_size(value: Value) -> int:
    sizes = {t.shape[0] if t.dim() > 0 else -1 for t in tensors(value)}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [tuple(t.shape) for t in tensors(value)]
        raise ValueError(
            f"input tensors must share a batch dimension 0, but got shapes {shapes}; "
            "give every tensor the same number of rows"
        )
    return sizes.pop()


def _check_dense(value: Value) -> None:
    for k, t in enumerate(tensors(value)):
        if t.layout != torch.strided:
            raise TypeError(
                f"input tensor {k} has layout {t.layout}, but micro-batches are row views of "
                "dense tensors; pass x.to_dense(), or build the sparse tensor inside a layer"
            )


def scatter(value: Value, chunks: int) -> list[Value]:
    """Split a batch into at most ``chunks`` micro-batches along dimension 0.

    A batch of ``n < chunks`` rows gives ``n`` micro-batches; an empty batch gives one.

    >>> [t.shape[0] for t in scatter(torch.zeros(10, 3), 4)]
    [3, 3, 2, 2]
    """
    _check_dense(value)
    m = max(1, min(chunks, _batch_size(value)))
    if isinstance(value, Tensor):
        return list(value.tensor_split(m))
    columns = [t.tensor_split(m) for t in value]
    return [tuple(col[i] for col in columns) for i in range(m)]


def gather(values: Sequence[Value]) -> Value:
    """Concatenate micro-batch outputs along dimension 0 (no copy for a single micro-batch)."""
    if len(values) == 1:
        return values[0]
    first = values[0]
    if isinstance(first, Tensor):
        return torch.cat(values)  # type: ignore[arg-type]
    return tuple(torch.cat([tensors(v)[k] for v in values]) for k in range(len(first)))
