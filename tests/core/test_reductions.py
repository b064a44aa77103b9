"""What a loss divides by, learned from its operations (pipepar.core.reductions), and losses
joined by it in a pipe: code written without pipepar in mind, compared with the plain model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.core.forms import Averaged, Const, Summed, Unknown
from pipepar.core.losses import LossNotJoinable
from pipepar.core.reductions import Probe
from tests._foreign_models import NanoGPT, nano_batch


def _form(fn, x, y):
    with Probe([x, y], rows=x.shape[0]) as probe:
        value = fn(x, y)
    return probe.form_of(value)


X, Y = torch.randn(6, 5), torch.tensor([0, 1, -1, 2, -1, 4])


@pytest.mark.parametrize(
    ("fn", "count"),
    [
        (lambda x, y: F.cross_entropy(x, y, ignore_index=-1), 4.0),
        (lambda x, y: F.cross_entropy(x, y.clamp(min=0), reduction="sum") / x.size(0), 6.0),
        (lambda x, y: F.cross_entropy(x, y.clamp(min=0), reduction="sum") / x.numel(), 30.0),
        (
            lambda x, y: (
                (F.cross_entropy(x, y.clamp(min=0), reduction="none") * (y >= 0)).sum()
                / (y >= 0).sum()
            ),
            4.0,
        ),
        (lambda x, y: F.mse_loss(x, torch.zeros_like(x)), 30.0),
        (lambda x, y: x.pow(2).mean() * 0.5 + 1.0, 30.0),
        (lambda x, y: F.cross_entropy(x, y.clamp(min=0), reduction="none").mean(0), 6.0),
        (lambda x, y: F.gaussian_nll_loss(x, torch.zeros_like(x), x.exp()), 30.0),
    ],
    ids=[
        "ce-ignore",
        "over-rows",
        "over-elements",
        "masked-mean",
        "mse",
        "mean-plus-const",
        "per-row-mean-over-dim-0",
        "reads-its-values",  # F.gaussian_nll_loss checks its variances: no meta run
    ],
)
def test_means_are_learned_with_their_count(fn, count) -> None:
    form = _form(fn, X, Y)
    assert isinstance(form, Averaged)
    assert form.count([X, Y], 6) == count


def test_sums_and_division_by_a_given_number_are_sums() -> None:
    assert isinstance(_form(lambda x, y: x.sum() * 3, X, Y), Summed)
    assert isinstance(_form(lambda x, y: F.l1_loss(x, x * 0, reduction="sum") / 7, X, Y), Summed)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x.mean().log(),
        lambda x, y: x.mean() * x.sum(),
        lambda x, y: F.cross_entropy(x, y, ignore_index=-1) + x.pow(2).mean(),
        lambda x, y: x.sum() + 1.0,
        lambda x, y: x.max(),
    ],
    ids=["log-of-mean", "product", "two-counts", "sum-plus-const", "max"],
)
def test_what_no_share_can_join_is_unknown(fn) -> None:
    assert isinstance(_form(fn, X, Y), Unknown)


# -- in a pipe --------------------------------------------------------------------------------
def _nano() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("how", ["call", "step"])
def test_a_models_own_loss_under_another_name_joins_exactly(schedule: str, how: str) -> None:
    idx, targets = nano_batch()  # unevenly padded: real targets differ per micro-batch
    plain = _nano()
    _, expected = plain(idx, targets)
    expected.backward()
    model = _nano()
    pipe = pipepar.wrap(model, split=["h.2"], devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    for _ in range(2):  # the first call learns, the second follows what it learned
        model.zero_grad()
        if how == "call":
            _, loss = pipe(idx, targets)
            loss.backward()
        else:
            loss = pipe.step(idx, targets)
        torch.testing.assert_close(loss.detach(), expected.detach())
        for got, want in zip(_grads(model), _grads(plain)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda o, t: F.cross_entropy(o, t.clamp(min=0), reduction="sum"),
        lambda o, t: F.cross_entropy(o, t.clamp(min=0), reduction="sum") / o.size(0),
        lambda o, t: (
            (F.cross_entropy(o, t.clamp(min=0), reduction="none") * (t >= 0)).sum() / (t >= 0).sum()
        ),
    ],
    ids=["sums", "per-row", "masked"],
)
def test_a_loss_fn_that_sums_or_divides_by_its_own_count_joins_exactly(loss_fn) -> None:
    x, y = torch.randn(12, 8), torch.randint(0, 5, (12,))
    y[:5] = -1
    plain = _seq()
    expected = loss_fn(plain(x), y)
    expected.backward()
    model = _seq()
    pipe = pipepar.wrap(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    loss = pipe.step(x, y, loss_fn)
    torch.testing.assert_close(loss, expected.detach())
    for got, want in zip(_grads(model), _grads(plain)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_loss_no_share_can_join_stops_before_any_gradient() -> None:
    model = _seq()
    pipe = pipepar.wrap(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(4, 8), torch.randn(4, 5)
    with pytest.raises(LossNotJoinable, match="items="):
        pipe.step(x, y, lambda o, t: F.mse_loss(o, t).log())
    assert all(p.grad is None for p in model.parameters())


class _ToMeta(torch.overrides.TorchFunctionMode):
    """What a rank that only follows the last stage does: the caller's values become meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def meta(v):
            return v.to("meta") if isinstance(v, torch.Tensor) else v

        return func(*[meta(a) for a in args], **{k: meta(v) for k, v in (kwargs or {}).items()})


def test_a_loss_on_a_meta_output_and_a_caller_target_is_learned() -> None:
    """The shadow of the last stage on another rank: the output is meta, the target is the
    caller's; the probe's own look at the loss's elements must not mix the two devices."""
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with _ToMeta(), Probe([y], rows=4) as probe:
        value = F.mse_loss(x.to("meta"), y)
    form = probe.form_of(value)
    assert isinstance(form, Averaged)
    assert form.count([torch.zeros(2, 3)], 2) == 6.0


def test_a_size_read_off_packed_items_makes_constants() -> None:
    x = torch.randn(2, 3)
    grid = torch.tensor([[1, 2, 4], [1, 4, 2]])  # a micro-batch's images, packed
    with Probe([x, grid], rows=2, tracked=1) as probe:
        positions = torch.arange(grid[:, 1:].max())  # Qwen3-VL's vision positions
        loss = (x.sum(1) * positions[:2]).mean()
    assert isinstance(probe.form_of(positions), Const)
    assert isinstance(probe.form_of(loss), Averaged)
