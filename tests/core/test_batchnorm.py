"""Deferred batch norm tracks the statistics of the whole mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.batchnorm import DeferredBatchNorm


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)
    )


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_equal_full_batch(checkpoint: str, momentum: float | None) -> None:
    model = _model()
    model[1].momentum = momentum
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model,
        [2, 3],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    assert isinstance(pipe[1], DeferredBatchNorm)
    for _ in range(3):
        x = torch.randn(10, 3, 4, 4) * 3 + 1
        pipe(x).sum().backward()
        plain(x)
    bn, ref = pipe[1], plain[1]
    torch.testing.assert_close(bn.running_mean, ref.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_var, ref.running_var, atol=1e-5, rtol=1e-5)
    assert int(bn.num_batches_tracked) == 3
    pipe.eval()
    plain.eval()
    torch.testing.assert_close(pipe(x), plain(x), atol=1e-5, rtol=1e-5)


def test_plain_batch_norm_tracks_each_microbatch() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 3], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(8, 3, 4, 4) * 3 + 1
    pipe(x)
    plain(x)
    assert int(pipe[1].num_batches_tracked) == 4
    assert not torch.allclose(pipe[1].running_var, plain[1].running_var)


def test_state_dict_keys_unchanged() -> None:
    model = _model()
    keys = list(model.state_dict())
    pipe = pipepar.wrap(model, [2, 3], devices=["cpu", "cpu"], deferred_batch_norm=True)
    assert list(pipe.state_dict()) == keys
    _model().load_state_dict(pipe.state_dict())
