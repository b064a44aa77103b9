"""A small image classifier with every kind of layer the planner meets: conv, batch norm,
pooling, dropout, flatten, linear. Sized for CPU tests and benchmarks."""

from __future__ import annotations

from torch import nn

from models._build import DeviceLike, on_device

__all__ = ["convnet"]


def convnet(
    channels: int = 16, num_classes: int = 10, *, dropout: float = 0.1, device: DeviceLike = None
) -> nn.Sequential:
    """Conv-BN-ReLU-pool, two more convs, global 4x4 pooling and a linear head: 12 layers.

    Args:
        channels: Channels of the first conv; the next two have twice as many.
        num_classes: Size of the last linear layer.
        dropout: Probability of the dropout after the second conv.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model; ``(N, 3, H, W) -> (N, num_classes)`` for any ``H, W >= 2``.

    Example:
        >>> model = convnet(8)
        >>> len(model), model(torch.randn(2, 3, 32, 32)).shape
        (12, torch.Size([2, 10]))
    """
    for name, value in (("channels", channels), ("num_classes", num_classes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int; pass e.g. {name}=16")
    wide = 2 * channels
    with on_device(device):
        return nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, wide, 3, padding=1),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Conv2d(wide, wide, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(wide * 16, num_classes),
        )
