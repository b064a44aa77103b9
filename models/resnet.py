"""ResNet (He et al., 2015) as one flat ``nn.Sequential``: stem layers, one layer per block.

Layout of ``resnet(50)``: ``conv1, bn1, relu, maxpool``, then the 3 + 4 + 6 + 3 bottleneck
blocks each as one layer, then ``avgpool, flatten, fc`` (23 layers). Block attributes use
torchvision's names (``conv1, bn1, ..., downsample``), so the ``state_dict`` of
``sequentialize(torchvision.models.resnet50())`` loads into ``resnet50()`` unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from models._build import DeviceLike, on_device

__all__ = ["BasicBlock", "Bottleneck", "resnet", "resnet50"]


class BasicBlock(nn.Module):
    """Two 3x3 convs plus the identity (or a 1x1 projection): the ResNet-18/34 block.

    Example:
        >>> block = BasicBlock(64, 128, stride=2)
        >>> block(torch.randn(1, 64, 8, 8)).shape
        torch.Size([1, 128, 4, 4])
    """

    expansion = 1

    def __init__(self, in_channels: int, width: int, *, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _projection(in_channels, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, plus the identity: the ResNet-50+ block.

    The stride sits on the 3x3 conv, as in torchvision ("ResNet v1.5").

    Example:
        >>> block = Bottleneck(64, 64)
        >>> block(torch.randn(1, 64, 8, 8)).shape
        torch.Size([1, 256, 8, 8])
    """

    expansion = 4

    def __init__(self, in_channels: int, width: int, *, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _projection(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


_Block = type[BasicBlock] | type[Bottleneck]

# Blocks per stage for each depth, and which block type it uses.
_DEPTHS: dict[int, tuple[_Block, list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
    152: (Bottleneck, [3, 8, 36, 3]),
}


def resnet(
    depth: int = 50,
    num_classes: int = 1000,
    *,
    width: int = 64,
    device: DeviceLike = None,
) -> nn.Sequential:
    """ResNet-18/34/50/101/152 as a flat ``nn.Sequential``, one layer per residual block.

    Args:
        depth: 18, 34, 50, 101 or 152.
        num_classes: Size of the final linear layer.
        width: Channels of the stem and of the first stage's blocks (64 in the paper); the
            stages use width, 2x, 4x, 8x. Shrink it for fast tests.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Example:
        >>> model = resnet(18, num_classes=10, width=16)
        >>> len(model), model(torch.randn(2, 3, 32, 32)).shape
        (15, torch.Size([2, 10]))
    """
    if depth not in _DEPTHS:
        raise ValueError(f"depth={depth!r} is not a ResNet; pass one of {sorted(_DEPTHS)}")
    if num_classes < 1 or width < 1:
        raise ValueError(
            f"num_classes={num_classes} and width={width} must be >= 1; pass e.g. width=64"
        )
    block, counts = _DEPTHS[depth]
    with on_device(device):
        layers = _stem(width) + _blocks(block, counts, width) + _head(block, width, num_classes)
        model = nn.Sequential(*layers)
        _initialize(model)
    return model


def resnet50(
    num_classes: int = 1000, *, width: int = 64, device: DeviceLike = None
) -> nn.Sequential:
    """ResNet-50 as a flat ``nn.Sequential`` of 23 layers (4 stem, 16 bottlenecks, 3 head).

    Args:
        num_classes: Size of the final linear layer.
        width: Stem and first-stage width (64 in the paper).
        device: Where to build the parameters, e.g. ``"meta"``.

    Returns:
        The model; ``(N, 3, H, W) -> (N, num_classes)``.

    Example:
        >>> model = resnet50(device="meta")
        >>> sum(p.numel() for p in model.parameters())
        25557032
    """
    return resnet(50, num_classes, width=width, device=device)


def _projection(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    # A 1x1 conv matches shapes when the block changes resolution or channel count.
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


def _stem(width: int) -> list[nn.Module]:
    return [
        nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    ]


def _blocks(block: _Block, counts: list[int], width: int) -> list[nn.Module]:
    layers: list[nn.Module] = []
    channels = width
    for stage, count in enumerate(counts):
        stage_width = width * 2**stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            layers.append(block(channels, stage_width, stride=stride))
            channels = stage_width * block.expansion
    return layers


def _head(block: _Block, width: int, num_classes: int) -> list[nn.Module]:
    features = width * 8 * block.expansion
    return [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(features, num_classes)]


def _initialize(model: nn.Module) -> None:
    # He initialisation for convs, unit-scale batch norm: the paper's recipe.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
