"""Splitting and joining batches."""

from __future__ import annotations

import pytest
import torch

from pipepar.core.microbatch import check_rows, check_value, gather, scatter


@pytest.mark.parametrize(
    ("rows", "chunks", "sizes"),
    [(10, 4, [3, 3, 2, 2]), (3, 8, [1, 1, 1]), (0, 4, [0]), (8, 1, [8])],
)
def test_scatter_sizes(rows: int, chunks: int, sizes: list[int]) -> None:
    parts = scatter(torch.zeros(rows, 2), chunks)
    assert [p.shape[0] for p in parts] == sizes


def test_scatter_is_a_view_and_gather_restores() -> None:
    x = torch.arange(20.0).reshape(10, 2)
    parts = scatter(x, 3)
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(gather(parts), x)


def test_tuples_split_together() -> None:
    x, idx = torch.randn(6, 3), torch.arange(6)
    parts = scatter((x, idx), 2)
    assert [tuple(t.shape[0] for t in p) for p in parts] == [(3, 3), (3, 3)]
    joined = gather(parts)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], idx)


def test_check_value() -> None:
    t = torch.zeros(1)
    assert check_value(t, what="x") is t
    with pytest.raises(TypeError, match=r"x must be a Tensor.*got tuple of \(Tensor, int\)"):
        check_value((t, 1), what="x")
    with pytest.raises(TypeError, match=r"got tuple of \(empty\)"):
        check_value((), what="x")


def _never() -> str:
    raise AssertionError("the name is built only for the message")


@pytest.mark.parametrize(
    "value", [torch.zeros(3, 2), (torch.zeros(3), torch.zeros(3, 4, dtype=torch.long))]
)
def test_check_rows_passes_the_batch_on_dimension_0(value: object) -> None:
    check_rows(value, 3, _never)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (torch.tensor(1.0), r"\(\)"),
        (torch.zeros(6, 2), r"\(6, 2\)"),
        ((torch.zeros(3, 2), torch.tensor(0)), r"\[\(3, 2\), \(\)\]"),
    ],
)
def test_check_rows_names_the_layer_the_shape_and_the_rows(value: object, shown: str) -> None:
    match = rf"layer 7 \(Sum\) returned shape {shown} for a micro-batch of 3 rows.*dimension 0"
    with pytest.raises(ValueError, match=match):
        check_rows(value, 3, lambda: "layer 7 (Sum)")  # type: ignore[arg-type]
