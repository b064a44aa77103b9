"""Deferred batch norm tracks the statistics of the whole mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.batchnorm import defer_statistics


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
    assert type(pipe[1]) is nn.BatchNorm2d
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
    pipe = pipepar.wrap(
        model, [2, 3], devices=["cpu", "cpu"], chunks=4, batch_coupling="per-micro-batch"
    )
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


# -- the layer is kept: subclasses run their own forward -------------------------------------------
class _Shifted(nn.BatchNorm2d):
    """A user's subclass whose forward changes the input before the batch norm and the
    output after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 2 - 1) + 0.5


class _SelfUpdating(nn.BatchNorm2d):
    """A subclass that updates its running mean itself: it cannot be deferred exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            assert self.running_mean is not None
            self.running_mean.mul_(0.9).add_(0.1 * x.mean((0, 2, 3)).detach())
        return nn.functional.batch_norm(x, None, None, self.weight, self.bias, True, 0.0)


class _SelfUpdatingByItems(nn.BatchNorm2d):
    """A subclass that decays its running mean by assigning into its items, then normalizes as
    the layer does: deferred, each micro-batch would decay it once more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            assert self.running_mean is not None
            self.running_mean[:] = 0.9 * self.running_mean
        return super().forward(x)


class _Net(nn.Module):
    """A model that is not an nn.Sequential (the pipe cuts its own forward)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = norm
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(96, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)))


def _norm(kind: str, momentum: float | None) -> nn.Module:
    if kind == "timm":
        from timm.layers import BatchNormAct2d

        return BatchNormAct2d(6, momentum=momentum, act_layer=nn.ReLU)  # type: ignore[arg-type]
    return _Shifted(6, momentum=momentum)


def _wrapped(
    kind: str, momentum: float | None, sequential: bool, checkpoint: str = "never"
) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = _Net(_norm(kind, momentum))
    if sequential:
        model = nn.Sequential(model.conv, model.norm, model.head)  # type: ignore[assignment]
    plain = copy.deepcopy(model)
    classes = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    split: dict[str, object] = {"balance": [2, 1]} if sequential else {"split": ["head"]}
    pipe = pipepar.wrap(
        model,
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
        **split,  # type: ignore[arg-type]
    )
    assert [type(m) for m in model.modules()] == classes  # no layer replaced
    assert list(pipe.state_dict()) == keys
    return pipe, plain


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("sequential", [True, False], ids=["chain", "program"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind", ["timm", "subclass"])
def test_a_subclass_keeps_its_forward_and_tracks_the_whole_batch(
    kind: str, momentum: float | None, sequential: bool, checkpoint: str
) -> None:
    """timm's BatchNormAct2d (its activation after the batch norm) and a user's subclass:
    outputs and gradients are the plain layer's on each micro-batch, the running statistics
    and the evaluation outputs the plain model's on the whole mini-batch."""
    pipe, plain = _wrapped(kind, momentum, sequential, checkpoint)
    per_micro_batch = copy.deepcopy(plain)
    for _ in range(3):
        x = torch.randn(8, 3, 4, 4) * 3 + 1
        out = pipe(x)
        out.sum().backward()
        with torch.no_grad():
            plain(x)  # the statistics of the whole mini-batch
        ref = torch.cat([per_micro_batch(part) for part in x.chunk(4)])
        ref.sum().backward()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ours, theirs = dict(pipe.named_parameters()), dict(per_micro_batch.named_parameters())
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-4, rtol=1e-4)
    ours_state, plain_state = pipe.state_dict(), plain.state_dict()
    for key, value in plain_state.items():
        torch.testing.assert_close(ours_state[key], value, atol=1e-5, rtol=1e-5)
    pipe.eval()
    plain.eval()
    x = torch.randn(8, 3, 4, 4)
    torch.testing.assert_close(pipe(x), plain(x), atol=1e-5, rtol=1e-5)


def test_the_plain_layer_outside_a_pipe_is_untouched() -> None:
    """The hooks act inside a pipe's mini-batch only: the model called directly after wrapping
    updates its statistics as the plain layer does."""
    pipe, plain = _wrapped("timm", 0.1, False)
    del pipe
    x = torch.randn(8, 3, 4, 4)
    model = copy.deepcopy(plain)
    defer_statistics(model)
    torch.testing.assert_close(model(x), plain(x))
    torch.testing.assert_close(model.state_dict()["norm.running_var"], plain.norm.running_var)
    assert int(model.state_dict()["norm.num_batches_tracked"]) == 1


@pytest.mark.parametrize(
    ("norm", "write"), [(_SelfUpdating, "mul_"), (_SelfUpdatingByItems, "__setitem__")]
)
def test_a_subclass_that_updates_its_statistics_itself_is_refused_by_name(
    norm: type[nn.BatchNorm2d], write: str
) -> None:
    torch.manual_seed(0)
    model = _Net(norm(6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = pipepar.wrap(
        model, split=["head"], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True
    )
    refused = rf"'norm' \(.*{norm.__name__}\).*{write}.*deferred_batch_norm"
    with pytest.raises(ValueError, match=refused):
        pipe(torch.randn(4, 3, 4, 4)).sum().backward()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), key  # the failed step counted nothing
    refusing = pipepar.wrap(model, split=["head"], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match="module norm"):  # its own batch mean
        refusing(torch.randn(4, 3, 4, 4))
    plain = pipepar.wrap(
        model, split=["head"], devices=["cpu", "cpu"], chunks=2, batch_coupling="per-micro-batch"
    )
    plain(torch.randn(4, 3, 4, 4))  # without deferring it runs as it is


def test_a_timm_mobilenet_tracks_each_layers_inputs_over_the_mini_batch() -> None:
    """timm's MobileNetV3 (BatchNormAct2d throughout), built with random weights: training
    outputs are the plain model's micro-batch by micro-batch, and each batch norm's running
    statistics are those of all its inputs over the mini-batch (each micro-batch normalized by
    itself, as torchgpipe defines deferred batch norm); evaluation outputs match then."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)
    ref = copy.deepcopy(model)
    norms = {n: m for n, m in ref.named_modules() if isinstance(m, nn.BatchNorm2d)}
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in norms}
    for n, m in norms.items():
        m.register_forward_pre_hook(lambda _, args, n=n: inputs[n].append(args[0].detach()))
    paths = [u.path for u in pipepar.units(model)]
    pipe = pipepar.wrap(
        model,
        split=[paths[len(paths) // 2]],
        devices=["cpu", "cpu"],
        chunks=2,
        deferred_batch_norm=True,
    )
    assert {type(m).__name__ for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {
        "BatchNormAct2d"
    }
    for _ in range(2):
        x = torch.randn(4, 3, 32, 32)
        out = pipe(x)
        out.sum().backward()
        before = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in norms.items()}
        for seen in inputs.values():
            seen.clear()
        with torch.no_grad():
            torch.testing.assert_close(out, torch.cat([ref(part) for part in x.chunk(2)]))
        for n, m in norms.items():  # the mini-batch's statistics, folded in once
            whole, (mean, var) = torch.cat(inputs[n]), before[n]
            m.running_mean.copy_(mean.lerp(whole.mean((0, 2, 3)), 0.1))
            m.running_var.copy_(var.lerp(whole.var((0, 2, 3)), 0.1))
            m.num_batches_tracked.sub_(1)
    ours = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5)
    pipe.eval()
    ref.eval()
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(pipe(x), ref(x), atol=1e-5, rtol=1e-5)
