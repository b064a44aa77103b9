"""The benchmark model: ``depth`` x (Linear(width, width) + ReLU) as one flat ``nn.Sequential``."""

from __future__ import annotations

from torch import nn

from pipepar.zoo.building import DeviceLike, on_device

__all__ = ["mlp"]


def mlp(
    depth: int = 8,
    width: int = 1024,
    *,
    bias: bool = True,
    activation: type[nn.Module] = nn.ReLU,
    device: DeviceLike = None,
) -> nn.Sequential:
    """A stack of ``depth`` Linear + ReLU pairs, flattened into ``2 * depth`` layers.

    The default, 8 x (Linear(1024, 1024) + ReLU), is the model of ``benchmarks/``.

    Args:
        depth: Number of Linear + ReLU pairs.
        width: Input, hidden and output features.
        bias: Whether the linear layers have a bias.
        activation: The layer after each Linear, e.g. ``nn.GELU``.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model; ``(N, width) -> (N, width)``.

    Example:
        >>> model = mlp(depth=2, width=16)
        >>> len(model), model(torch.randn(3, 16)).shape
        (4, torch.Size([3, 16]))
    """
    for name, value in (("depth", depth), ("width", width)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int; pass e.g. {name}=8")
    with on_device(device):
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width, bias=bias), activation()]
        return nn.Sequential(*layers)
