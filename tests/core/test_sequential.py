"""sequentialize: torchvision layouts, custom chains, and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipepar.core.sequential import FunctionLayer, sequentialize

torchvision = pytest.importorskip("torchvision")


def _ids(module: nn.Module) -> set[int]:
    return {id(t) for t in list(module.parameters()) + list(module.buffers())}


@pytest.mark.parametrize("name", ["alexnet", "vgg11", "vgg16", "resnet18", "resnet50"])
def test_torchvision_models_same_outputs_and_shared_parameters(name: str) -> None:
    model = getattr(torchvision.models, name)(weights=None, num_classes=10).eval()
    layers = sequentialize(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(layers(x), model(x), atol=1e-5, rtol=0)
    assert _ids(layers) == _ids(model)
    assert not layers.training


def test_resnet_layout_is_stem_blocks_head() -> None:
    model = torchvision.models.resnet50(weights=None)
    layers = sequentialize(model)
    stem = [model.conv1, model.bn1, model.relu, model.maxpool]
    blocks = [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
    assert all(a is b for a, b in zip(layers[:4], stem, strict=True))
    assert all(a is b for a, b in zip(layers[4:-3], blocks, strict=True))
    assert layers[-3] is model.avgpool and layers[-1] is model.fc
    assert isinstance(layers[-2], nn.Flatten) and layers[-2].start_dim == 1


def test_alexnet_layout_flattens_features_and_classifier() -> None:
    model = torchvision.models.alexnet(weights=None)
    layers = sequentialize(model)
    expected = [*model.features, model.avgpool, None, *model.classifier]
    assert len(layers) == len(expected)
    for got, want in zip(layers, expected, strict=True):
        assert got is want or (want is None and isinstance(got, nn.Flatten))


def test_gradients_match_in_train_mode() -> None:
    model = torchvision.models.resnet18(weights=None, num_classes=5).train()
    layers = sequentialize(model)
    x = torch.randn(4, 3, 32, 32)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    layers(x).square().mean().backward()
    for want, p in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-5)


class _Chain(nn.Module):
    """A chain with functional calls and a nested chain child."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.inner = _Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        x = self.inner(x)
        x = F.adaptive_avg_pool2d(x, (1, 1)).flatten(1)
        return self.head(x * 2.0)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


def test_custom_chain_expands_children_and_converts_functions() -> None:
    model = _Chain().eval()
    layers = sequentialize(model)
    kinds = [type(layer) for layer in layers]
    assert kinds == [
        nn.Conv2d,
        FunctionLayer,
        nn.Conv2d,
        nn.BatchNorm2d,
        FunctionLayer,
        nn.Flatten,
        FunctionLayer,
        nn.Linear,
    ]
    assert layers[2] is model.inner.a and layers[3] is model.inner.b
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(layers(x), model(x), atol=1e-6, rtol=0)


def test_non_chain_child_stays_one_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Residual(), nn.Sequential(nn.ReLU(), nn.Linear(4, 3)))
    layers = sequentialize(model)
    assert [type(layer) for layer in layers] == [nn.Linear, _Residual, nn.ReLU, nn.Linear]
    assert layers[1] is model[1]
    x = torch.randn(3, 4)
    torch.testing.assert_close(layers(x), model(x))


def test_stateless_layer_called_twice_is_copied() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc2(self.act(self.fc1(x))))

    model = Twice()
    layers = sequentialize(model)
    assert len(layers) == 4 and layers[1] is not layers[3]
    x = torch.randn(2, 4)
    torch.testing.assert_close(layers(x), model(x))


def test_torch_flatten_keeps_its_default_start_dim() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flatten(self.fc(x))

    model = Flat()
    x = torch.randn(3, 4)
    assert sequentialize(model)(x).shape == model(x).shape == (12,)


def test_sequential_subclass_with_own_forward_is_traced_not_flattened() -> None:
    class Doubled(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(Doubled(nn.Linear(4, 4)), nn.ReLU())
    layers = sequentialize(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layers(x), model(x))


def test_function_layer_runs_a_tensor_method_by_name() -> None:
    layer = FunctionLayer("mean", dim=1)
    x = torch.randn(2, 5)
    torch.testing.assert_close(layer(x), x.mean(dim=1))
    assert "mean" in repr(layer) and "dim=1" in repr(layer)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * y


class _TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y


class _OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


class _UnusedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, self.training)


class _SharedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (_Residual(), "several operations"),
        (_TwoInputs(), "2 inputs"),
        (_TupleOut(), "output alone"),
        (_OwnParameter(), "reads 'scale' directly"),
        (_DataDependent(), "cannot trace"),
        (_UnusedChild(), "spare.weight"),
        (_FunctionalDropout(), "train/eval mode"),
        (_SharedWeights(), "called twice"),
        (nn.Linear(4, 4), "reads 'weight' directly"),
    ],
    ids=lambda v: type(v).__name__.strip("_") if isinstance(v, nn.Module) else "",
)
def test_non_chain_modules_are_refused(model: nn.Module, reason: str) -> None:
    with pytest.raises(TypeError) as info:
        sequentialize(model)
    message = str(info.value)
    assert type(model).__name__ in message
    assert reason in message
    assert "nn.Sequential by hand" in message


def test_torchvision_googlenet_is_refused_with_the_reason() -> None:
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False)
    with pytest.raises(TypeError, match="GoogLeNet"):
        sequentialize(model)


def test_not_a_module_is_refused() -> None:
    with pytest.raises(TypeError, match=r"module must be an nn\.Module, got function"):
        sequentialize(lambda x: x)  # type: ignore[arg-type]


def test_layout_keeps_the_models_own_names_both_ways() -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    layers = sequentialize(model)
    assert list(layers.state_dict()) == list(model.state_dict())
    assert {n for n, _ in layers.named_parameters()} == {n for n, _ in model.named_parameters()}
    assert "layer1.0.conv1.weight" in dict(layers.named_parameters())
    other = torchvision.models.resnet18(weights=None, num_classes=10)
    other.load_state_dict(layers.state_dict())
    layers.load_state_dict(other.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(layers.eval()(x), other.eval()(x))
