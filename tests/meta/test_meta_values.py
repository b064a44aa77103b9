"""MetaScalars: meta tensors whose value follows from known values answer reads as a real run
would (through lists of tensors, factories on meta, views and in-place writes); a read of a value
that depends on weights or activations raises, naming a fix."""

from __future__ import annotations

import pytest
import torch

from pipepar.meta.shapes import MetaShapes
from pipepar.meta.values import MetaScalars


def _ids(values: MetaScalars, value: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(value, device="meta")
    values.know(meta, value)
    return meta


@pytest.mark.parametrize("shapes", [None, MetaShapes()], ids=["kernels", "remembered"])
def test_reads_follow_the_values_a_real_run_computes(shapes: MetaShapes | None) -> None:
    real = torch.tensor([[0, 1, 2, 5, 6], [3, 4, 5, 6, 7]])
    for _ in range(2):  # the second time, outputs are made from remembered shapes
        with MetaScalars(shapes) as values:
            ids = _ids(values, real)
            joined = torch.cat([ids, ids + 1], dim=-1)  # a list of tensors
            positions = torch.arange(5, device="meta")  # a factory on meta
            first = ids[:, :1]  # a view
            diff = torch.diff(ids, prepend=first - 1, dim=-1)
            moved = ids.clone()
            moved.add_(positions)  # an in-place write
            assert joined.is_meta and diff.is_meta and moved.is_meta
            assert joined.sum().item() == torch.cat([real, real + 1], -1).sum().item()
            assert int(positions[-1]) == 4
            assert bool((diff != 1).any()) is True
            last = (diff != 1).cumsum(-1)[:, -1]
            assert (int(last[0]), int(last[1])) == (1, 0)
            assert moved.sum().item() == (real + torch.arange(5)).sum().item()


def test_a_read_of_an_activation_raises_naming_a_fix() -> None:
    weight = torch.empty(5, 3, device="meta")
    with MetaScalars() as values:
        ids = _ids(values, torch.tensor([1, 2]))
        score = torch.nn.functional.embedding(ids, weight).sum()
        with pytest.raises(ValueError, match=r"depends on weights or activations.*device='cpu'"):
            bool(score > 0)
