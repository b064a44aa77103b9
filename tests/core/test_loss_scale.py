"""The loss scale a step seeds its backwards with, and the overflow check the ranks agree on."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pipepar.core.loss_scale import check_scaler, loss_scale, overflowed
from pipepar.core.losses import loss_shares

CPU = torch.device("cpu")


def test_no_scaler_or_a_disabled_one_scales_by_one() -> None:
    assert loss_scale(None, CPU) == 1.0
    assert loss_scale(torch.amp.GradScaler("cpu", enabled=False), CPU) == 1.0


def test_a_fresh_scaler_makes_its_scale_so_unscale_finds_it() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert loss_scale(scaler, CPU) == 1024.0
    w = nn.Parameter(torch.ones(2))
    w.grad = torch.full((2,), 2048.0)
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.unscale_(opt)  # a scaler never asked for its scale has none: unscale_ would raise
    assert torch.equal(w.grad, torch.full((2,), 2.0))


def test_not_a_scaler_is_a_type_error_naming_what_it_lacks() -> None:
    with pytest.raises(TypeError, match=r"scaler must be .* got str without scale, unscale_"):
        check_scaler("fp16")


def test_seeds_are_the_shares_times_the_scale_read_once_the_shares_are_learned() -> None:
    targets = [torch.tensor([1, -100]), torch.tensor([-100, -100, 2, 0])]
    # a mean over the real targets, 1 and 2 of them (a loss function no step learned yet)
    loss_fn = functools.partial(nn.functional.cross_entropy)
    shares = loss_shares(loss_fn, targets, [2, 4]).scaled(2.0**16)
    seeds = shares.seeds
    with pytest.raises(RuntimeError, match="micro-batch 0 was read before"):
        seeds[0]  # the shares are unknown before micro-batch 0's loss
    shares.head_of(loss_fn, targets)(torch.randn(2, 3), 0)
    assert list(shares.weights) == [1 / 3, 2 / 3]
    assert list(seeds) == [2**16 / 3, 2**17 / 3]
    assert list(shares.spread(lambda count: 2 * count, 2).seeds) == list(seeds)


def test_overflowed_sees_inf_and_nan_and_never_overflows_itself() -> None:
    big = torch.full((4,), 3e38)  # finite, though its sum is not
    assert overflowed([big], CPU).item() == 0.0
    assert overflowed([big, torch.tensor([1.0, float("inf")])], CPU).item() == 1.0
    assert overflowed([torch.tensor([float("nan")], dtype=torch.float16)], CPU).item() == 1.0
    assert overflowed([], CPU).item() == 0.0
