"""VGG (Simonyan & Zisserman, 2014) as one flat ``nn.Sequential``, torchvision's layer order.

``vgg(16)`` has the same layers, shapes and order as
``sequentialize(torchvision.models.vgg16())``, so that ``state_dict`` loads into it.
"""

from __future__ import annotations

from torch import nn

from models._build import DeviceLike, on_device

__all__ = ["vgg", "vgg16"]

# Output channels per 3x3 conv; "M" is a 2x2 max pool. Keys are the depth (weighted layers).
_CONFIGS: dict[int, str] = {
    11: "64 M 128 M 256 256 M 512 512 M 512 512 M",
    13: "64 64 M 128 128 M 256 256 M 512 512 M 512 512 M",
    16: "64 64 M 128 128 M 256 256 256 M 512 512 512 M 512 512 512 M",
    19: "64 64 M 128 128 M 256 256 256 256 M 512 512 512 512 M 512 512 512 512 M",
}


def vgg(
    depth: int = 16,
    num_classes: int = 1000,
    *,
    batch_norm: bool = False,
    hidden: int = 4096,
    dropout: float = 0.5,
    device: DeviceLike = None,
) -> nn.Sequential:
    """VGG-11/13/16/19 as a flat ``nn.Sequential``.

    Args:
        depth: Number of weighted layers: 11, 13, 16 or 19.
        num_classes: Size of the last linear layer.
        batch_norm: Insert ``BatchNorm2d`` after every conv (torchvision's ``vgg16_bn``).
        hidden: Width of the two hidden fully connected layers (4096 in the paper).
        dropout: Dropout probability after fc6 and fc7.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model; input ``(N, 3, H, W)`` with ``H, W >= 32``, output ``(N, num_classes)``.

    Example:
        >>> model = vgg(11, num_classes=10, device="meta")
        >>> len(model)
        30
    """
    if depth not in _CONFIGS:
        raise ValueError(f"depth={depth!r} is not a VGG; pass one of {sorted(_CONFIGS)}")
    if num_classes < 1 or hidden < 1:
        raise ValueError(
            f"num_classes={num_classes} and hidden={hidden} must be >= 1; pass e.g. num_classes=10"
        )
    with on_device(device):
        features = _features(_CONFIGS[depth], batch_norm)
        return nn.Sequential(*features, *_classifier(num_classes, hidden, dropout))


def vgg16(
    num_classes: int = 1000,
    *,
    batch_norm: bool = False,
    hidden: int = 4096,
    dropout: float = 0.5,
    device: DeviceLike = None,
) -> nn.Sequential:
    """VGG-16 (configuration D) as a flat ``nn.Sequential`` of 40 layers (53 with batch norm).

    Args:
        num_classes: Size of the last linear layer.
        batch_norm: Insert ``BatchNorm2d`` after every conv.
        hidden: Width of the two hidden fully connected layers.
        dropout: Dropout probability after fc6 and fc7.
        device: Where to build the parameters, e.g. ``"meta"``.

    Returns:
        The model; ``(N, 3, H, W) -> (N, num_classes)``.

    Example:
        >>> model = vgg16(device="meta")
        >>> sum(p.numel() for p in model.parameters())
        138357544
    """
    return vgg(
        16, num_classes, batch_norm=batch_norm, hidden=hidden, dropout=dropout, device=device
    )


def _features(config: str, batch_norm: bool) -> list[nn.Module]:
    layers: list[nn.Module] = []
    channels = 3
    for item in config.split():
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        out = int(item)
        layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU(inplace=True))
        channels = out
    return layers + [nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(1)]


def _classifier(num_classes: int, hidden: int, dropout: float) -> list[nn.Module]:
    return [
        nn.Linear(512 * 7 * 7, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    ]
