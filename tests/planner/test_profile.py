"""The profiler: exact parameter bytes, activations against independent counts, meta == CPU."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import pipepar
from pipepar.planner.allocator_log import AllocatorLog
from pipepar.planner.optimizer_state import optimizer_cost, resolve_optimizer
from pipepar.planner.profile import LayerProfile, Profile, profile

_SAME_ON_EVERY_DEVICE = (
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "output_bytes",
    "output_shape",
    "type_name",
    "name",
    "deferred_grad_bytes",
    "keeps_incoming_grad",
    "splits_backward",
)


def _torchvision(name: str) -> nn.Sequential:
    with torch.device("meta"):
        model = getattr(torchvision.models, name)(weights=None)
    return pipepar.sequentialize(model)


def test_exported_names() -> None:
    from pipepar.planner.model_profile import profile as profile_any_model

    assert (pipepar.profile, pipepar.Profile, pipepar.LayerProfile) == (
        profile_any_model,
        Profile,
        LayerProfile,
    )


@pytest.mark.parametrize(("name", "count"), [("alexnet", 61_100_840), ("resnet50", 25_557_032)])
def test_exact_parameter_bytes_of_torchvision_layouts(name: str, count: int) -> None:
    model = _torchvision(name)
    prof = profile(model, torch.empty(2, 3, 224, 224, device="meta"), optimizer="adam")
    assert prof.total("params_bytes") == 4 * count  # the published parameter counts, fp32
    for layer, child in zip(prof.layers, model):
        expected = sum(p.numel() * 4 for p in child.parameters())
        assert layer.params_bytes == layer.grads_bytes == expected
        assert layer.optimizer_bytes == 2 * expected  # Adam: exp_avg + exp_avg_sq
    assert prof.layers[-1].output_shape == (2, 1000)


def test_alexnet_saved_activations_match_the_allocator_within_10_percent() -> None:
    model = pipepar.sequentialize(torchvision.models.alexnet(weights=None))
    x = torch.randn(4, 3, 224, 224)
    prof = profile(model, x, device="meta", optimizer=None)
    predicted = prof.total("activation_bytes")
    # Independent count: what the CPU allocator still holds after a plain forward with grad
    # (everything autograd keeps), minus the final output, which nothing saves.
    with AllocatorLog() as log:
        y = model(x)
    independent = log.net_bytes - y.numel() * y.element_size()
    assert independent > 10 * 2**20
    assert abs(predicted - independent) / independent < 0.10


def test_meta_and_cpu_agree() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 32),
        nn.GELU(),
        nn.Linear(32, 10),
    )
    x = torch.randn(6, 3, 16, 16)
    on_meta = profile(model, x, device="meta")
    on_cpu = profile(model, x, device="cpu")
    for a, b in zip(on_meta.layers, on_cpu.layers):
        for field in _SAME_ON_EVERY_DEVICE:
            assert getattr(a, field) == getattr(b, field), (a.index, field)
        # The CPU allocator also sees kernels' scratch buffers, which meta cannot have.
        assert b.backward_peak_bytes >= a.backward_peak_bytes
        assert a.forward_ms is None and b.forward_ms is not None and b.backward_ms is not None
    assert on_meta.input_bytes == on_cpu.input_bytes == x.numel() * 4


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_profile_taken_under_no_grad_or_inference_mode_is_the_training_steps(
    mode: str, device: str
) -> None:
    """A profile measures a training step: called from inside ``torch.no_grad()`` (an
    evaluation loop) or ``torch.inference_mode()`` it gives the figures it gives outside, where
    it used to keep no graph (every activation 0) or fail; the caller's mode is left as it was."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    expected = profile(model, torch.randn(4, 16), device=device)
    with getattr(torch, mode)():
        x = torch.randn(4, 16)
        got = profile(model, x, device=device)
        assert not torch.is_grad_enabled()
    assert sum(layer.activation_bytes for layer in got.layers) > 0
    for a, b in zip(expected.layers, got.layers, strict=True):
        for field in (*_SAME_ON_EVERY_DEVICE, "backward_peak_bytes", "backward_points"):
            assert getattr(a, field) == getattr(b, field), (a.index, field)


def test_inplace_ops_views_and_outputs_are_counted_at_their_creator() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(32, 4))
    prof = profile(model, torch.randn(8, 16), optimizer=None)
    linear, relu, flatten, last = prof.layers
    # ReLU rewrites the Linear's output in place and saves it; the next Linear saves it too.
    # One storage, counted once, at the layer that created it.
    assert linear.activation_bytes == 8 * 32 * 4
    assert relu.activation_bytes == flatten.activation_bytes == 0
    assert flatten.output_bytes == 8 * 32 * 4  # a view: handed on, not allocated
    assert last.activation_bytes == 0 and last.output_bytes == 8 * 4 * 4


def test_shared_frozen_buffers_and_mixed_dtypes() -> None:
    tied = nn.Linear(8, 8)
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    half = nn.Linear(8, 8).to(torch.bfloat16)
    model = nn.Sequential(
        tied, nn.ReLU(), tied, frozen, nn.BatchNorm1d(8), Cast(torch.bfloat16), half
    )
    prof = profile(model, torch.randn(4, 8), optimizer="adam")
    layers = prof.layers
    assert layers[0].params_bytes == 72 * 4 and layers[2].params_bytes == 0  # shared: once
    assert (
        layers[3].params_bytes == 72 * 4 and layers[3].grads_bytes == layers[3].optimizer_bytes == 0
    )
    assert layers[4].params_bytes == 16 * 4  # weight and bias; running stats are buffers
    assert layers[6].params_bytes == layers[6].grads_bytes == 72 * 2  # bf16
    assert layers[6].optimizer_bytes == 2 * 72 * 2  # Adam keeps bf16 state for bf16 params
    assert layers[6].output_shape == (4, 8)


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


class Pair(nn.Module):
    """Takes and returns a tuple, as layers of two-stream models do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = xy
        return self.a(x), y * 2


def test_tuple_inputs_and_outputs() -> None:
    model = nn.Sequential(Pair(), Pair(), Sum())
    prof = profile(model, (torch.randn(4, 8), torch.randn(4, 8)), device="cpu")
    assert prof.input_shape == ((4, 8), (4, 8))
    assert prof.layers[0].output_shape == ((4, 8), (4, 8))
    assert prof.layers[2].output_shape == (4, 8)
    assert prof.batch_size == 4 and prof.timed


class Sum(nn.Module):
    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return xy[0] + xy[1]


def test_the_model_is_left_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True))
    x = torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x_before = x.clone()
    profile(model, x, device="cpu")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(x, x_before)


@pytest.mark.parametrize(
    ("optimizer", "factor"),
    [("adam", 2), ("adamw", 2), ("sgd", 0), ("sgd-momentum", 1), ("rmsprop", 1), (None, 0)],
)
def test_optimizer_state_is_what_the_optimizer_allocates(optimizer: object, factor: int) -> None:
    prof = profile(nn.Sequential(nn.Linear(32, 32)), torch.randn(2, 32), optimizer=optimizer)
    assert prof.layers[0].optimizer_bytes == factor * 33 * 32 * 4


def test_any_optimizer_class_or_instance() -> None:
    layer = nn.Linear(16, 16)
    params = 17 * 16 * 4
    assert (
        profile(nn.Sequential(layer), torch.randn(2, 16), optimizer=torch.optim.Adagrad)
        .layers[0]
        .optimizer_bytes
        == params
    )  # state_sum
    instance = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.5)
    assert resolve_optimizer(instance).kwargs["momentum"] == 0.5
    cost = optimizer_cost(resolve_optimizer(instance), [torch.empty(100, device="meta")])
    assert cost.state_bytes == 400
    assert (
        profile(nn.Sequential(layer), torch.randn(2, 16))
        .with_optimizer("sgd")
        .layers[0]
        .optimizer_bytes
        == 0
    )


class _CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        type(self).steps += 1
        return super().step(closure)


def test_each_kind_of_layer_is_stepped_once_and_arguments_tell_kinds_apart() -> None:
    model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(4)], nn.Linear(24, 8))
    _CountingSGD.steps = 0
    prof = profile(model, torch.randn(2, 24), optimizer=_CountingSGD)  # plain SGD: no state
    # two shapes x loop/multi-tensor x (state step + steady step) = 8, not 5 layers' 20
    assert _CountingSGD.steps == 8
    assert [layer.optimizer_bytes for layer in prof.layers] == [0] * 5
    prof = profile(model, torch.randn(4, 24), optimizer=_CountingSGD)
    assert _CountingSGD.steps == 8  # a later profile of the same model: measured already
    momentum = _CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    prof = profile(model, torch.randn(2, 24), optimizer=momentum)
    assert _CountingSGD.steps == 16
    assert [layer.optimizer_bytes for layer in prof.layers] == [600 * 4] * 4 + [200 * 4]


def test_any_model_profiles_by_its_units_and_plans() -> None:
    from models import transformers_zoo as zoo
    from pipepar.planner.model_profile import profile_model

    model, sample = zoo.gpt2(layers=2), zoo.sample("gpt2", batch=4)
    prof = pipepar.profile(model, sample)  # meta and adam, as for an nn.Sequential
    assert prof == profile_model(model, sample, device="meta", optimizer="adam")
    assert [layer.name for layer in prof.layers] == [u.path for u in pipepar.units(model)]
    assert prof.layers[0].optimizer_bytes == 2 * prof.layers[0].params_bytes  # Adam
    plan = pipepar.plan(prof, devices=2, chunks=2)
    assert sum(plan.balance) == len(prof.layers) and len(plan.balance) == 2
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    assert pipepar.profile(layers, torch.randn(2, 8)) == profile(layers, torch.randn(2, 8))
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, but got str"):
        pipepar.profile("a model", torch.randn(2, 8))  # type: ignore[arg-type]


def test_huge_models_profile_on_meta_without_memory() -> None:
    model = nn.Sequential(*[nn.Linear(16384, 16384, device="meta") for _ in range(4)])
    prof = profile(model, torch.empty(8, 16384, device="meta"), optimizer="adam")
    assert prof.total("params_bytes") == 4 * (16384 * 16384 + 16384) * 4
    assert prof.device == "meta" and not prof.timed


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": nn.Linear(2, 2)}, TypeError, "sequentialize"),
        ({"model": nn.Sequential()}, ValueError, "empty"),
        ({"sample": [1, 2]}, TypeError, "sample must be a tensor"),
        ({"device": "gpu"}, ValueError, "not a torch device"),
        ({"optimizer": "adamax9"}, ValueError, "optimizer='adamax9' is not known"),
        ({"optimizer": 3}, TypeError, "optimizer must be"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    args = {"model": nn.Sequential(nn.Linear(2, 2)), "sample": torch.randn(1, 2)} | kwargs
    with pytest.raises(error, match=match):
        profile(args.pop("model"), args.pop("sample"), **args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_matches_meta() -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    on_meta = profile(model, x, device="meta")
    on_cuda = profile(model, x, device="cuda")
    for a, b in zip(on_meta.layers, on_cuda.layers):
        for field in _SAME_ON_EVERY_DEVICE:
            assert getattr(a, field) == getattr(b, field)
        assert b.forward_ms is not None


def test_meta_profile_counts_attention_as_the_fused_kernel_keeps_it() -> None:
    import models

    model = models.gpt(2, 64, 4, 128, 64)
    ids = torch.randint(128, (4, 64))
    on_cpu = pipepar.profile(model, ids, device="cpu")
    on_meta = pipepar.profile(model, ids, device="meta")
    for cpu_layer, meta_layer in zip(on_cpu.layers, on_meta.layers):
        assert meta_layer.activation_bytes == cpu_layer.activation_bytes, cpu_layer.name


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_backward_points_reach_the_backward_peak(device: str) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.ReLU(inplace=True))
    for layer in profile(model, torch.randn(128, 64), device=device).layers:
        top = max(a + g for a, g in layer.backward_points)
        assert top == layer.backward_peak_bytes + layer.grads_bytes, layer.index
        assert max(g for _, g in layer.backward_points) == layer.grads_bytes
        # Keeping the graph frees nothing: never less alive than the ordinary backward.
        assert max(a for a, _ in layer.retained_points) >= max(a for a, _ in layer.backward_points)


def test_a_storage_address_reused_in_backward_is_not_counted_as_freed_twice() -> None:
    # A storage alive before the backward is freed, and a new storage takes its address:
    # freeing the new one frees nothing that was alive before (the profile was not repeatable
    # from run to run while it did).
    from pipepar.planner.backward_clock import BackwardClock

    class _Tracker:
        live_bytes = 100
        on_change = None

        def live_keys(self) -> set[int]:
            return {7}

    tracker = _Tracker()
    with BackwardClock(tracker, [], base=0) as clock:  # type: ignore[arg-type]
        clock._changed(7, -40)  # the old storage at address 7 goes
        clock._changed(7, +40)  # a new one takes the address
        clock._changed(7, -40)  # and goes too
    assert clock.freed == 40
