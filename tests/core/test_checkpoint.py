"""Recompute sees the same random numbers as the first forward; batch-norm stats are not doubled."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.recompute import should_checkpoint


def test_should_checkpoint_modes() -> None:
    assert [should_checkpoint("always", i, 3) for i in range(3)] == [True, True, True]
    assert [should_checkpoint("except_last", i, 3) for i in range(3)] == [True, True, False]
    assert [should_checkpoint("never", i, 3) for i in range(3)] == [False, False, False]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("recompute", ["in_place", "bubbles"])
def test_dropout_masks_match_under_recompute(checkpoint: str, recompute: str) -> None:
    # out = x * m0 * m1 * 4 elementwise, so d(sum out)/dx = out / x exactly when the masks that
    # backward used (recomputed, in B or in an R of its own) are the masks the forward used.
    model = nn.Sequential(nn.Dropout(0.5), nn.Identity(), nn.Dropout(0.5))
    options: dict[str, Any] = {"checkpoint": checkpoint, "recompute": recompute}
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu"] * 2, chunks=4, schedule="1f1b", **options)
    for _ in range(5):
        x = (torch.rand(16, 64) + 0.5).requires_grad_()
        out = pipe(x)
        out.sum().backward()
        assert 0 < (out == 0).float().mean() < 1
        torch.testing.assert_close(x.grad, out.detach() / x.detach())


def test_dropout_single_stage_matches_plain_per_microbatch() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8))
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [3], devices=["cpu"], chunks=4, checkpoint="always")
    x = torch.randn(8, 8)
    torch.manual_seed(11)
    pipe(x).sum().backward()
    torch.manual_seed(11)
    for part in x.chunk(4):
        plain(part).sum().backward()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_recompute_does_not_update_batch_norm_twice() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model,
        [1, 2],
        devices=["cpu", "cpu"],
        chunks=2,
        checkpoint="always",
        batch_coupling="per-micro-batch",
    )
    x = torch.randn(8, 4)
    pipe(x).sum().backward()
    for part in x.chunk(2):
        plain(part).sum().backward()
    bn, ref = pipe[1], plain[1]
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
