"""profile_model and ``wrap(sample=...)`` over the torchvision classification zoo and timm.

One model per family of ``torchvision.models.list_models(module=torchvision.models)`` (a family
is the builder's module: every ResNet and ResNeXt runs the same code), at few pixels. Many
families have a unit whose first operation writes into its input (ResNet's ``relu``, a
``ReLU(inplace=True)`` after the unit ``bn1``), which the profile hands a value the unit before
made, as the pipe does. Each family must plan a two-stage split from a CPU profile, run it with
outputs and gradients equal to the plain model's called on one micro-batch at a time (eval
mode: dropout draws nothing), and profile on meta. Around them: units called more than once,
batch norm in training mode (per micro-batch, its statistics untouched by planning), and the
planner's memory predictions for stages holding in-place units against measured peaks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import get_model, get_model_builder, list_models
from torchvision.models.convnext import CNBlockConfig, ConvNeXt
from torchvision.models.densenet import DenseNet
from torchvision.models.efficientnet import EfficientNet, MBConvConfig
from torchvision.models.maxvit import MaxVit
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3
from torchvision.models.regnet import BlockParams, RegNet
from torchvision.models.shufflenetv2 import ShuffleNetV2
from torchvision.models.swin_transformer import SwinTransformer
from torchvision.models.vision_transformer import VisionTransformer

import pipepar
from pipepar.core.named_schedules import make
from pipepar.planner.measure import measure_split
from pipepar.planner.model_profile import profile_model
from pipepar.planner.stage_memory import MemoryModel

CLASSES = 3
RTOL = 1e-5

Build = Callable[[], nn.Module]


def _zoo(name: str, **kwargs: object) -> Build:
    return lambda: get_model(name, weights=None, num_classes=CLASSES, **kwargs)


def _narrow(name: str, width: int = 64) -> Build:
    """The model with its classifier's hidden Linears ``width`` wide (AlexNet's and VGG's are
    4096 wide: 55M and 120M weights that take seconds to initialise), built on ``meta`` and
    then initialised on the CPU by each module's own ``reset_parameters``."""

    def build() -> nn.Module:
        with torch.device("meta"):
            model = get_model(name, weights=None, num_classes=CLASSES)
            head = model.classifier
            linears = [k for k, m in enumerate(head) if isinstance(m, nn.Linear)]
            for n, k in enumerate(linears):
                wide = head[k].in_features if n == 0 else width
                head[k] = nn.Linear(wide, CLASSES if n == len(linears) - 1 else width)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        return model

    return build


# Families whose smallest model takes long to profile on CPU (hundreds of operations, or
# attention over 224 pixels) run their own code at a few channels and layers: each keeps its
# kinds of blocks (strided and residual ones, squeeze-excitation where the family has it).
def _convnext() -> nn.Module:
    return ConvNeXt([CNBlockConfig(8, 16, 2), CNBlockConfig(16, None, 2)], num_classes=CLASSES)


def _densenet() -> nn.Module:
    return DenseNet(8, (2, 2), num_init_features=16, bn_size=2, num_classes=CLASSES)


def _efficientnet() -> nn.Module:
    """efficientnet_b0's MBConv blocks (squeeze-excitation, a residual one) in two stages."""
    stages = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(6, 3, 2, 8, 16, 2)]
    return EfficientNet(stages, dropout=0.2, num_classes=CLASSES)


def _maxvit() -> nn.Module:
    """maxvit_t takes 224 pixels and no fewer: every stage's grid holds whole 7 x 7 windows."""
    return MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[8, 16],
        block_layers=[1, 1],
        head_dim=4,
        stochastic_depth_prob=0.0,
        num_classes=CLASSES,
    )


def _mobilenetv2() -> nn.Module:
    """Expansions 1 and 6, strided and residual inverted residuals, at a quarter width."""
    stages = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]
    return MobileNetV2(CLASSES, width_mult=0.25, inverted_residual_setting=stages)


def _mobilenetv3() -> nn.Module:
    """mobilenet_v3_small's first blocks (ReLU and hardswish, with and without
    squeeze-excitation, strided and residual) at half width."""
    blocks = [
        InvertedResidualConfig(16, 3, 16, 16, True, "RE", 2, 1, 0.5),
        InvertedResidualConfig(16, 3, 72, 24, False, "RE", 2, 1, 0.5),
        InvertedResidualConfig(24, 3, 88, 24, False, "RE", 1, 1, 0.5),
        InvertedResidualConfig(24, 5, 96, 40, True, "HS", 2, 1, 0.5),
    ]
    return MobileNetV3(blocks, last_channel=64, num_classes=CLASSES)


def _regnet() -> nn.Module:
    """regnet_y_400mf's design (grouped bottlenecks with squeeze-excitation) 4 blocks deep."""
    design = BlockParams.from_init_params(
        depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25
    )
    return RegNet(design, num_classes=CLASSES, stem_width=8)


def _shufflenet() -> nn.Module:
    """Downsampling and channel-split units in three stages, narrow."""
    return ShuffleNetV2([2, 1, 1], [8, 16, 32, 64, 128], num_classes=CLASSES)


def _swin() -> nn.Module:
    return SwinTransformer([4, 4], 8, [2, 2], [1, 2], [2, 2], num_classes=CLASSES)


def _vit() -> nn.Module:
    return VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=CLASSES)


# family (the builder's module) -> (model, image side in pixels)
FAMILIES: dict[str, tuple[Build, int]] = {
    "alexnet": (_narrow("alexnet"), 64),
    "convnext": (_convnext, 32),
    "densenet": (_densenet, 32),
    "efficientnet": (_efficientnet, 32),
    "googlenet": (_zoo("googlenet", aux_logits=False, init_weights=False), 32),
    # AuxLogits: a unit the sample does not call in eval mode
    "inception": (_zoo("inception_v3", aux_logits=True, init_weights=False), 75),
    "maxvit": (_maxvit, 32),
    "mnasnet": (_zoo("mnasnet0_5"), 32),
    "mobilenetv2": (_mobilenetv2, 32),
    "mobilenetv3": (_mobilenetv3, 32),
    "regnet": (_regnet, 32),
    "resnet": (_zoo("resnet18"), 32),
    "shufflenetv2": (_shufflenet, 32),
    "squeezenet": (_zoo("squeezenet1_0"), 32),
    "swin_transformer": (_swin, 32),
    "vgg": (_narrow("vgg11_bn"), 32),
    "vision_transformer": (_vit, 32),
}


def _timm(name: str, **kwargs: object) -> Build:
    def build() -> nn.Module:
        timm = pytest.importorskip("timm")
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)

    return build


TIMM: dict[str, tuple[Build, int]] = {
    "resnet18": (_timm("resnet18"), 32),  # act1: ReLU(inplace=True), a unit of its own
    "vit_tiny": (_timm("vit_tiny_patch16_224", img_size=32), 32),
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the models are small, and a second thread waiting for a busy core
    would make the file's time vary severalfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_torchvision_classifier_has_a_family_here() -> None:
    names = list_models(module=torchvision.models)
    families = {get_model_builder(n).__module__.rpartition(".")[2] for n in names}
    assert families == set(FAMILIES), "add each new family's smallest model to FAMILIES"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torchvision_family_plans_and_equals_the_model(family: str) -> None:
    build, side = FAMILIES[family]
    _plans_and_equals(build().eval(), torch.randn(2, 3, side, side))


@pytest.mark.parametrize("name", sorted(TIMM))
def test_timm_model_plans_and_equals_the_model(name: str) -> None:
    build, side = TIMM[name]
    _plans_and_equals(build().eval(), torch.randn(2, 3, side, side))


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class _CalledAgain(nn.Module):
    """One in-place activation for the whole model, and a block applied a second time late."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.blocks = nn.ModuleList(_Block(8) for _ in range(3))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm(self.stem(x)))
        for block in self.blocks:
            x = self.act(block(x) + x)
        x = self.act(self.blocks[0](x))
        return self.head(x.mean((2, 3)))


def test_units_called_again_plan_and_equal_the_model() -> None:
    _plans_and_equals(_CalledAgain().eval(), torch.randn(4, 3, 8, 8))


def _plans_and_equals(model: nn.Module, x: torch.Tensor) -> None:
    pipe = pipepar.wrap(model, devices=["cpu", "cpu"], sample=x, chunks=2)
    try:
        assert pipe.layout.pp == 2 and sum(pipe.balance) == len(pipepar.units(model))
        got = pipe(x)
        weight = torch.randn_like(got)
        (got * weight).sum().backward()
    finally:
        pipe.close()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _equals_per_micro_batch(model, x, got, weight, grads)
    _profiles_on_meta(model, x)


def _equals_per_micro_batch(
    model: nn.Module,
    x: torch.Tensor,
    got: torch.Tensor,
    weight: torch.Tensor,
    grads: dict[str, torch.Tensor | None],
) -> None:
    """The pipe's output and gradients against the plain model's called on each micro-batch
    in turn: the same computations, so they agree to rounding. (Against one call on the whole
    batch they need not: the first convolutions' gradients of some random models are sums
    with so much cancellation that the batch size alone moves them far beyond rounding.)"""
    expected = torch.cat([model(part) for part in x.chunk(2)])
    (expected * weight).sum().backward()
    _close(got.detach(), expected.detach(), "output")
    for name, p in model.named_parameters():
        _close(grads[name], p.grad, f"gradient of {name}")


def _profiles_on_meta(model: nn.Module, x: torch.Tensor) -> None:
    """The model moved to meta profiles; its in-place units are marked as such (no stage may
    begin at one)."""
    units = pipepar.units(model, x)
    model.to("meta")
    prof = profile_model(model, x.to("meta"), device="meta")
    assert [layer.name for layer in prof.layers] == [u.path for u in units]
    for unit, layer in zip(units, prof.layers):
        if getattr(unit.module, "inplace", False):
            assert layer.modifies_input, f"{unit.path} writes into its input"


def _close(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None and b is None:  # a unit the sample does not call (inception's AuxLogits)
        return
    assert a is not None and b is not None, f"{what} is missing on one side"
    scale = b.abs().max().clamp_min(1e-6)
    err = ((a - b).abs().max() / scale).item()
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def test_training_batch_norm_per_micro_batch_and_statistics_kept() -> None:
    """In training mode the pipe normalises each micro-batch by its own statistics and updates
    the running ones once per micro-batch, in order: as the plain model called on each
    micro-batch in turn. Planning from the sample changes no statistic."""
    model = get_model("resnet18", weights=None, num_classes=CLASSES)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 64, 64)
    before = {name: b.clone() for name, b in model.named_buffers()}
    refusing = pipepar.wrap(model, devices=["cpu", "cpu"], sample=x, chunks=2)
    with pytest.raises(pipepar.BatchCoupled, match="batch_norm"):
        refusing(x)  # micro-batch statistics are not the plain model's: asked for below
    refusing.close()
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), f"the refused call changed {name}"
    pipe = pipepar.wrap(
        model, devices=["cpu", "cpu"], sample=x, chunks=2, batch_coupling="per-micro-batch"
    )
    try:
        for name, b in model.named_buffers():
            assert torch.equal(b, before[name]), f"planning changed {name}"
        got = pipe(x)
        weight = torch.randn_like(got)
        (got * weight).sum().backward()
    finally:
        pipe.close()
    grads = {name: p.grad for name, p in model.named_parameters()}
    _equals_per_micro_batch(plain, x, got, weight, grads)
    buffers = dict(plain.named_buffers())
    for name, b in model.named_buffers():
        _close(b.float(), buffers[name].float(), name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_in_place_units_stage_peaks_within_1_percent_of_measured(schedule: str) -> None:
    """A stack with in-place ReLUs profiled unit by unit: every split the planner may choose
    (none begins at an in-place unit) predicts each stage's peak within 1% of the peak of the
    stages run for real."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(512, 10),
    )
    x = torch.randn(16, 3, 32, 32)
    prof = profile_model(model, x, device="cpu", optimizer="sgd-momentum")
    in_place = [i for i, layer in enumerate(prof.layers) if layer.modifies_input]
    assert in_place == [2, 5, 8]
    n, m = len(model), 4
    memory = MemoryModel(
        prof, make(schedule, 2, m, n_workers=2), checkpoint="never", foreach=[False] * 2
    )
    for cut in (c for c in range(1, n) if c not in in_place):
        predicted = [memory.stage(0, 0, cut - 1).peak_bytes, memory.stage(1, cut, n - 1).peak_bytes]
        measured = measure_split(
            model, x, [cut, n - cut], chunks=m, optimizer="sgd-momentum", schedule=schedule
        )
        for j, (want, got) in enumerate(zip(predicted, measured)):
            assert abs(want - got) / got < 0.01, f"cut {cut}, stage {j}: {want} vs {got}"
