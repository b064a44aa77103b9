"""The sequential model zoo: layouts, torchvision parity, meta builds, registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from pipepar.core.sequential import sequentialize

torchvision = pytest.importorskip("torchvision")


def _by_index(model: nn.Module) -> dict[str, torch.Tensor]:
    """State by layer index (a sequentialized model names its tensors as the original does)."""
    rename = getattr(model, "index_name", lambda k: k)
    return {rename(k): v for k, v in model.state_dict().items()}


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _by_index(model).items()}


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# (ours, torchvision's): builders that should give the same layout and parameter shapes.
_PAIRS = {
    "alexnet": (lambda: models.alexnet(10), lambda: torchvision.models.alexnet(num_classes=10)),
    "vgg16": (lambda: models.vgg16(10), lambda: torchvision.models.vgg16(num_classes=10)),
    "vgg11_bn": (lambda: models.vgg(11, batch_norm=True), lambda: torchvision.models.vgg11_bn()),
    "resnet50": (lambda: models.resnet50(10), lambda: torchvision.models.resnet50(num_classes=10)),
    "resnet18": (lambda: models.resnet(18, 7), lambda: torchvision.models.resnet18(num_classes=7)),
}


@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_layout_matches_sequentialized_torchvision(name: str) -> None:
    ours, theirs = _PAIRS[name]
    with torch.device("meta"):
        mine, reference = ours(), sequentialize(theirs())
    assert _shapes(mine) == _shapes(reference)
    assert [type(a).__name__ for a in mine] == [type(b).__name__ for b in reference]


@pytest.mark.parametrize("name", ["alexnet", "resnet50"])
def test_torchvision_weights_load_and_give_the_same_outputs(name: str) -> None:
    ours, theirs = _PAIRS[name]
    reference = sequentialize(theirs().eval())
    mine = ours().eval()
    mine.load_state_dict(_by_index(reference))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), reference(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", models.names())
def test_every_model_builds_on_meta_without_memory(name: str) -> None:
    model = models.get(name, device="meta")
    assert isinstance(model, nn.Sequential) and len(model) > 0
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_meta_forward_gives_output_shapes() -> None:
    meta = torch.device("meta")
    image = torch.empty(2, 3, 224, 224, device=meta)
    assert models.alexnet(device=meta)(image).shape == (2, 1000)
    assert models.alexnet(original=True, device=meta)(image).shape == (2, 1000)
    assert models.vgg16(num_classes=5, device=meta)(image).shape == (2, 5)
    assert models.resnet50(device=meta)(image).shape == (2, 1000)
    ids = torch.zeros(2, 1024, dtype=torch.long, device=meta)
    assert models.gpt(device=meta)(ids).shape == (2, 1024, 50257)


def test_device_argument_and_bad_device() -> None:
    assert models.mlp(depth=1, width=4, device="cpu")[0].weight.device.type == "cpu"
    with pytest.raises(ValueError, match="device='nowhere'"):
        models.mlp(device="nowhere")


# --- AlexNet, the 2012 two-GPU variant ------------------------------------------------------


def test_original_alexnet_channels_groups_and_lrn() -> None:
    model = models.alexnet(original=True, device="meta")
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [96, 256, 384, 384, 256]
    assert [c.groups for c in convs] == [1, 2, 1, 2, 2]
    kinds = [type(m) for m in model]
    lrn_at = [i for i, k in enumerate(kinds) if k is nn.LocalResponseNorm]
    # Response normalisation follows the ReLU of conv1 and conv2, then max pooling.
    assert [kinds[i - 2 : i + 2] for i in lrn_at] == [
        [nn.Conv2d, nn.ReLU, nn.LocalResponseNorm, nn.MaxPool2d]
    ] * 2


def test_original_alexnet_conv2_sees_only_its_own_gpu_half() -> None:
    model = models.alexnet(original=True)
    conv2, conv3 = model[4], model[8]
    x = torch.randn(1, 96, 13, 13)
    bumped = x.clone()
    bumped[:, :48] += 1.0  # change only "GPU 0"'s half of conv1's maps
    with torch.no_grad():
        delta2 = (conv2(bumped) - conv2(x)).abs().amax(dim=(0, 2, 3))
        y = torch.randn(1, 256, 13, 13)
        y_bumped = y.clone()
        y_bumped[:, :128] += 1.0
        delta3 = (conv3(y_bumped) - conv3(y)).abs().amax(dim=(0, 2, 3))
    assert delta2[:128].min() > 0 and delta2[128:].max() == 0
    assert delta3[192:].min() > 0  # conv3 crosses GPUs: GPU 1's half sees GPU 0's maps


def test_original_alexnet_lrn_is_the_papers_formula() -> None:
    lrn = models.alexnet(original=True)[2]
    a = torch.rand(2, 16, 3, 3) * 10
    k, n, alpha, beta = 2.0, 5, 1e-4, 0.75
    squares = torch.nn.functional.pad(a.square(), (0, 0, 0, 0, n // 2, n // 2))
    window = torch.stack([squares[:, i : i + n].sum(1) for i in range(a.shape[1])], dim=1)
    torch.testing.assert_close(lrn(a), a / (k + alpha * window) ** beta)


@pytest.mark.parametrize("original", [False, True])
def test_alexnet_trains_on_small_images(original: bool) -> None:
    model = models.alexnet(num_classes=10, original=original, hidden=64, dropout=0.0)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(10, (4,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# --- ResNet, VGG, MLP -------------------------------------------------------------------------


def test_resnet_is_stem_blocks_head_and_runs() -> None:
    model = models.resnet(50, num_classes=3, width=8)
    kinds = [type(m).__name__ for m in model]
    assert kinds[:4] == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"]
    assert kinds[4:-3] == ["Bottleneck"] * (3 + 4 + 6 + 3)
    assert kinds[-3:] == ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_small_vgg_runs() -> None:
    model = models.vgg(11, num_classes=4, hidden=16)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_mlp_is_the_benchmark_stack() -> None:
    model = models.mlp(device="meta")
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU] * 8
    assert {(m.in_features, m.out_features) for m in model[::2]} == {(1024, 1024)}
    small = models.mlp(depth=3, width=6)
    x = torch.randn(5, 6)
    expected = x
    for linear in small[::2]:
        expected = torch.relu(linear(expected))
    torch.testing.assert_close(small(x), expected)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: models.alexnet(num_classes=0), "num_classes=0"),
        (lambda: models.alexnet(dropout=1.5), "dropout=1.5"),
        (lambda: models.vgg(12), "depth=12"),
        (lambda: models.resnet(20), "depth=20"),
        (lambda: models.mlp(depth=0), "depth=0"),
        (lambda: models.gpt(width=10, heads=3), "width=10"),
        (lambda: models.gpt(depth=-1), "depth=-1"),
    ],
)
def test_bad_options_name_the_argument(build, argument: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=argument):
        build()


# --- GPT ----------------------------------------------------------------------------------


def _tiny_gpt(**options: float) -> nn.Sequential:
    return models.gpt(depth=2, width=32, heads=4, vocab=50, seq_len=16, **options)  # type: ignore[arg-type]


def test_gpt_layers_each_take_and_return_one_tensor() -> None:
    model = _tiny_gpt()
    assert len(model) == 2 + 3
    value = torch.randint(50, (2, 16))
    for layer in model:
        value = layer(value)
        assert isinstance(value, torch.Tensor)
    assert value.shape == (2, 16, 50)


def test_gpt_is_causal() -> None:
    model = _tiny_gpt().eval()
    ids = torch.randint(50, (1, 12))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert (a[:, 7:] - b[:, 7:]).abs().amax(dim=-1).min() > 0


def test_gpt_parameter_count_follows_the_formula() -> None:
    depth, width, vocab, seq_len = 12, 768, 50257, 1024
    block = 2 * 2 * width + (width + 1) * 3 * width + (width + 1) * width
    block += (width + 1) * 4 * width + (4 * width + 1) * width
    expected = vocab * width + seq_len * width + depth * block + 2 * width + width * vocab
    assert _numel(models.gpt(device="meta")) == expected


def test_gpt_rejects_too_long_input_and_learns() -> None:
    model = _tiny_gpt()
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    ids = torch.randint(50, (4, 16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# --- registry -------------------------------------------------------------------------------


def test_registry_builds_by_name_with_or_without_prefix() -> None:
    assert {"alexnet", "vgg16", "resnet50", "gpt", "mlp"} <= set(models.names())
    a = models.get("mlp", depth=2, width=4, device="meta")
    b = models.get("models.mlp", depth=2, width=4, device="meta")
    assert _shapes(a) == _shapes(b) == _shapes(models.mlp(depth=2, width=4, device="meta"))


def test_registry_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"name='lenet'.*'alexnet'"):
        models.get("lenet")
    with pytest.raises(TypeError, match="colour"):
        models.get("mlp", colour="red")
