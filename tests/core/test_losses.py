"""The shares that join micro-batch losses into the whole batch's loss (pipepar.core.losses)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipepar.core.losses import kept_loss, loss_shares, nothing, split_target

ROWS = [3, 3, 2]


def _joined(loss_fn, output, target, rows, items=None):
    """The pipe's rule by hand: each micro-batch's loss times its share, summed."""
    outs, targets = list(output.split(rows)), split_target(target, rows)
    shares = loss_shares(loss_fn, targets, rows, items)
    head = shares.head_of(loss_fn, targets)
    losses = [head(o, i) for i, o in enumerate(outs)]  # micro-batch 0's shows the shares
    return sum(w * loss for loss, w in zip(losses, shares.weights))


@pytest.mark.parametrize(
    "loss_fn",
    [
        F.cross_entropy,
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(weight=torch.rand(5) + 0.1, label_smoothing=0.2),
        functools.partial(F.cross_entropy, ignore_index=4),
        nn.CrossEntropyLoss(reduction="sum"),
        lambda o, t: F.nll_loss(o.log_softmax(-1), t.clamp(min=0)),
    ],
    ids=["F.ce", "CELoss", "weighted-smoothed", "partial-ignore4", "sum", "custom-rows"],
)
def test_class_losses_join_to_the_whole_batch(loss_fn) -> None:
    out = torch.randn(8, 5, requires_grad=True)
    y = torch.tensor([1, -100, -100, 4, 4, -100, 2, 0])
    if isinstance(loss_fn, functools.partial):  # its own ignored class
        y = torch.where(y < 0, 4, y)
    expected = loss_fn(out, y)
    (g_expected,) = torch.autograd.grad(expected, out)
    got = _joined(loss_fn, out, y, ROWS)
    (g_got,) = torch.autograd.grad(got, out)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_got, g_expected, rtol=1e-6, atol=1e-7)


def test_a_micro_batch_of_ignored_targets_adds_nothing_and_no_nan() -> None:
    out = torch.randn(6, 5, requires_grad=True)
    y = torch.tensor([-100, -100, -100, 1, 2, -100])
    got = _joined(F.cross_entropy, out, y, [3, 3])
    (g,) = torch.autograd.grad(got, out)
    torch.testing.assert_close(got, F.cross_entropy(out, y))
    assert torch.isfinite(g).all() and (g[:3] == 0).all()


def test_custom_loss_with_items_joins_exactly_and_skips_empty_micro_batches() -> None:
    def masked_mse(o, t):  # averages over the rows whose mask is set
        y, mask = t
        return ((o - y).pow(2).sum(1) * mask).sum() / mask.sum()

    out = torch.randn(8, 4, requires_grad=True)
    y, mask = torch.randn(8, 4), torch.tensor([1.0, 0, 0, 0, 0, 0, 1, 1])
    expected = masked_mse(out, (y, mask))
    got = _joined(masked_mse, out, (y, mask), [2, 4, 2], items=lambda t: t[1].sum())
    (g,) = torch.autograd.grad(got, out)
    (g_expected,) = torch.autograd.grad(expected, out)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(g, g_expected)
    assert not torch.isnan(got)


def test_losses_over_rows_are_weighted_by_rows() -> None:
    out, y = torch.randn(8, 3), torch.randn(8, 3)
    torch.testing.assert_close(_joined(F.mse_loss, out, y, ROWS), F.mse_loss(out, y))
    targets = split_target(y, ROWS)
    shares = loss_shares(F.mse_loss, targets, ROWS)
    shares.head_of(F.mse_loss, targets)(out[:3], 0)
    assert list(shares.weights) == [9 / 24, 9 / 24, 6 / 24] and shares.total == 24  # elements


def test_spread_over_replicas_gives_the_global_mean() -> None:
    # Two replicas with 1 and 3 real targets: averaged gradients must be the global mean's.
    out = torch.randn(8, 5, requires_grad=True)
    y = torch.tensor([1, -100, -100, -100, 2, 3, 4, -100])
    halves = [(out[:4], y[:4]), (out[4:], y[4:])]
    parts = []
    for o, t in halves:
        targets = split_target(t, [2, 2])
        shares = loss_shares(F.cross_entropy, targets, [2, 2]).spread(lambda c: 4.0, replicas=2)
        head = shares.head_of(F.cross_entropy, targets)
        losses = [head(p, i) for i, p in enumerate(o.split(2))]
        parts.append(sum(w * loss for loss, w in zip(losses, shares.weights)))
    mean_of_replicas = (parts[0] + parts[1]) / 2
    torch.testing.assert_close(mean_of_replicas, F.cross_entropy(out, y))


def test_split_target_errors_and_structures() -> None:
    with pytest.raises(ValueError, match="target has 5 rows but the input has 8"):
        split_target(torch.zeros(5), ROWS)
    parts = split_target({"y": torch.arange(8), "scale": 2.0}, ROWS)
    assert [p["y"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(p["scale"] == 2.0 for p in parts)
    assert split_target(None, ROWS) == [None, None, None]


def test_items_must_be_callable() -> None:
    with pytest.raises(TypeError, match="items must be callable"):
        loss_shares(F.mse_loss, [torch.zeros(1)], [1], items=3)  # type: ignore[arg-type]


def test_nothing_is_a_zero_loss_with_zero_gradients() -> None:
    out = torch.randn(3, 2, requires_grad=True)
    loss = nothing((out, {"b": out * 2}))
    (g,) = torch.autograd.grad(loss, out)
    assert loss.item() == 0 and (g == 0).all()


def test_a_learned_loss_form_is_known_at_the_start_of_the_next_step_of_its_kind() -> None:
    """Its replicas can then sum their counts before anything runs."""
    loss_fn = functools.partial(F.cross_entropy, ignore_index=-1)
    out, y = torch.randn(6, 5), torch.tensor([1, -1, 2, 2, -1, -1])
    targets = split_target(y, [3, 3])
    first = loss_shares(loss_fn, targets, [3, 3])
    assert first.learning()
    first.head_of(loss_fn, targets)(out[:3], 0)
    y2 = torch.tensor([-1, -1, -1, 4, 4, -1])
    second = loss_shares(loss_fn, split_target(y2, [3, 3]), [3, 3])
    assert not second.learning() and list(second) == [0.0, 1.0]  # counted from its own targets


@pytest.mark.parametrize("loss_fn", [F.mse_loss, F.smooth_l1_loss])
def test_a_kept_loss_holds_its_own_bytes_not_the_element_wise_buffer(loss_fn) -> None:
    """torch's element-wise losses return a scalar over the whole element-wise buffer; what a
    step keeps until the mini-batch's end is that value in a storage of its own."""
    out = torch.randn(64, 32, requires_grad=True)
    loss = loss_fn(out, torch.randn(64, 32))
    assert loss.untyped_storage().nbytes() == out.numel() * out.element_size()  # torch's habit
    kept = kept_loss(loss)
    assert kept.untyped_storage().nbytes() == loss.element_size()
    assert not kept.requires_grad and torch.equal(kept, loss.detach())
    small = (out * 2).sum()
    assert kept_loss(small).data_ptr() == small.data_ptr()  # a value of its own: not copied


@pytest.mark.parametrize("model", ["chain", "any model"])
def test_a_steps_last_stage_keeps_no_element_wise_buffer_per_micro_batch(model, monkeypatch):
    """One process: the last stage's loss of each micro-batch, kept to the mini-batch's end,
    holds a scalar's bytes (it held each micro-batch's whole output before: 8 x 8 KiB here)."""
    import pipepar
    from pipepar.core.step import StageStep
    from pipepar.program.driver import Driver

    kept: list[int] = []
    forward, drive = StageStep.forward, Driver.run

    def watched(self, i, x):  # a chain's last stage returns its loss
        y = forward(self, i, x)
        if self.head is not None:
            kept.append(y.untyped_storage().nbytes())
        return y

    def driven(self):  # any model's micro-batch ends with its loss as the driver's result
        drive(self)
        if isinstance(self.result, torch.Tensor):
            kept.append(self.result.untyped_storage().nbytes())

    monkeypatch.setattr(StageStep, "forward", watched)
    monkeypatch.setattr(Driver, "run", driven)
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)]
    net = nn.Sequential(*layers) if model == "chain" else _Blocks(layers)
    plain = [p.detach().clone() for p in net.parameters()]
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    kwargs = {"balance": [2, 1]} if model == "chain" else {"split": ["2"]}
    pipe = pipepar.wrap(net, devices=["cpu", "cpu"], chunks=8, **kwargs)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    assert len(kept) == 8 and all(n == 4 for n in kept)
    with torch.no_grad():
        for p, q in zip(net.parameters(), plain):
            p.copy_(q)
    assert loss == pytest.approx(F.mse_loss(net(x), y).item(), rel=1e-6)


class _Blocks(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x
