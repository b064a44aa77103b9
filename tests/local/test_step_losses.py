"""``Pipe.step`` with losses that do not average over rows: the loss and every gradient equal
``loss_fn(model(x), y).backward()`` on the whole batch, for every schedule and uneven batches,
and no micro-batch without a real target turns the loss into nan."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL

TARGETS = torch.tensor([1, -100, -100, -100, -100, 3, -100, 4, 0, -100, -100])  # 11 rows


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))


def _compare(loss_fn, y: torch.Tensor, *, schedule: str = "1f1b", chunks: int = 4, **step) -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    balance = [2, 1, 1, 1] if schedule in VIRTUAL else [3, 2]
    pipe = pipepar.wrap(model, balance, devices=["cpu", "cpu"], chunks=chunks, schedule=schedule)
    x = torch.randn(len(y), 6)
    expected = loss_fn(plain(x), y)
    expected.backward()
    loss = pipe.step(x, y, loss_fn, **step)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("schedule", NAMES)
def test_ignore_index_over_every_schedule(schedule: str) -> None:
    _compare(F.cross_entropy, TARGETS, schedule=schedule)


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.5, 0.2]), label_smoothing=0.1),
        functools.partial(F.nll_loss, ignore_index=-100),
        nn.CrossEntropyLoss(reduction="sum"),
    ],
    ids=["module", "weighted-smoothed", "nll-partial", "sum"],
)
@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_torch_losses_join_exactly(loss_fn, chunks: int) -> None:
    _compare(loss_fn, TARGETS, chunks=chunks)


def test_a_custom_loss_says_what_it_counts() -> None:
    def token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        real = y != -100
        return -(out.log_softmax(-1)[real].gather(1, y[real, None])).sum() / real.sum()

    _compare(token_mean, TARGETS, items=lambda y: (y != -100).sum())


def test_the_old_nan_case_is_gone() -> None:
    # chunks=4 puts rows 1..4 (all ignored) alone in micro-batch 1: a mean over nothing
    _compare(F.cross_entropy, TARGETS, chunks=4, schedule="gpipe")


# A sum over the real targets divided by a count of a larger batch (torchtitan's
# ``global_valid_tokens``: every micro-batch of every accumulation step) that the loss function
# holds: the same for every micro-batch, so the micro-batches' losses add up.
COUNT = torch.tensor(16)


def _summed_over(out: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y, reduction="sum", ignore_index=-100) / count


class _SummedOver:
    def __init__(self, count: torch.Tensor) -> None:
        self.count = count

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _summed_over(out, y, self.count)


def _default_count(out: torch.Tensor, y: torch.Tensor, count: torch.Tensor = COUNT) -> torch.Tensor:
    return _summed_over(out, y, count)


def _closing_over(count: torch.Tensor):
    return lambda out, y: _summed_over(out, y, count)


@pytest.mark.parametrize(
    "loss_fn",
    [
        functools.partial(_summed_over, count=COUNT),
        lambda out, y: _summed_over(out, y, COUNT),  # the module's variable
        _closing_over(COUNT + 0),
        _default_count,
        _SummedOver(COUNT.float()),
    ],
    ids=["partial", "global", "closure", "default", "object"],
)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_sum_over_a_count_the_loss_function_holds_joins_exactly(loss_fn, schedule: str) -> None:
    _compare(loss_fn, TARGETS, schedule=schedule)


def test_a_count_made_from_the_target_outside_torch_is_still_refused() -> None:
    def outside(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        count = torch.from_numpy((y != -100).numpy().sum(keepdims=True))  # this micro-batch's
        return _summed_over(out, y, count)

    with pytest.raises(pipepar.LossNotJoinable, match="div"):
        _compare(outside, TARGETS)
