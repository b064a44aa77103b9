"""AlexNet as one flat ``nn.Sequential``: torchvision's single tower or the 2012 two-GPU net.

Layer map of ``alexnet(original=True)`` against Krizhevsky, Sutskever & Hinton (2012), whose
net ran split over two GPUs, each holding half of every layer's kernels:

====  ==================================  ==============================================
idx   layer                               paper (per GPU halves)
====  ==================================  ==============================================
0-3   Conv 96 11x11/4, ReLU, LRN, Pool    conv1: 48 + 48 kernels, each sees all 3 inputs
4-7   Conv 256 5x5 groups=2, ReLU, LRN,   conv2: 128 + 128, each sees only its own GPU's
      Pool                                48 channels (that is ``groups=2``)
8-9   Conv 384 3x3, ReLU                  conv3: 192 + 192, crosses GPUs (all 256 inputs)
10-11 Conv 384 3x3 groups=2, ReLU         conv4: own GPU's 192 channels only
12-14 Conv 256 3x3 groups=2, ReLU, Pool   conv5: own GPU's 192 channels only
15-16 AdaptiveAvgPool 6x6, Flatten        (6x6x256 = 9216 features; any input >= 63 px)
17-19 Linear 4096, ReLU, Dropout          fc6: 2048 + 2048, crosses GPUs
20-22 Linear 4096, ReLU, Dropout          fc7: 2048 + 2048, crosses GPUs
23    Linear num_classes                  fc8
====  ==================================  ==============================================

LRN is the paper's response normalisation, ``b = a / (k + alpha * sum(a^2))^beta`` over
``n = 5`` neighbouring channels with ``k = 2``, ``alpha = 1e-4``, ``beta = 0.75``.
``nn.LocalResponseNorm`` divides ``alpha`` by ``n``, so it gets ``alpha = 5e-4``.
The paper pads conv1's 224 px input to 227; ``padding=2`` gives the same 55x55 maps.
"""

from __future__ import annotations

from torch import nn

from pipepar.zoo.building import DeviceLike, on_device

__all__ = ["alexnet"]


def alexnet(
    num_classes: int = 1000,
    *,
    original: bool = False,
    hidden: int = 4096,
    dropout: float = 0.5,
    device: DeviceLike = None,
) -> nn.Sequential:
    """AlexNet as a flat ``nn.Sequential`` (22 layers; 24 with ``original=True``).

    Args:
        num_classes: Size of the last linear layer.
        original: ``False``: torchvision's single-tower layout (64-192-384-256-256 channels,
            same layer order and shapes, so ``sequentialize(torchvision.models.alexnet())``'s
            ``state_dict`` loads into it). ``True``: the 2012 paper's two-GPU net
            (96-256-384-384-256 channels, ``groups=2`` where a GPU saw only its own half,
            LocalResponseNorm after conv1 and conv2); see the module docstring for the map.
        hidden: Width of the two hidden fully connected layers (4096 in the paper); shrink it
            for small synthetic runs.
        dropout: Dropout probability before (torchvision) or after (paper) fc6 and fc7.
        device: Where to build the parameters, e.g. ``"meta"`` to allocate nothing.

    Weights use He initialisation (the last layer ``N(0, 0.01)``), biases zero.

    Returns:
        The model; input ``(N, 3, H, W)`` with ``H, W >= 63``, output ``(N, num_classes)``.

    Example:
        >>> model = alexnet(num_classes=10, hidden=512)
        >>> model(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 10])
    """
    _check_positive(num_classes=num_classes, hidden=hidden)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1); pass e.g. dropout=0.5")
    with on_device(device):
        if original:
            layers = _paper_features() + _paper_classifier(num_classes, hidden, dropout)
        else:
            layers = _tower_features() + _tower_classifier(num_classes, hidden, dropout)
        model = nn.Sequential(*layers)
        _initialize(model)
    return model


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int; pass e.g. {name}=10")


def _initialize(model: nn.Sequential) -> None:
    # He initialisation keeps activations at unit scale through the ReLUs (torch's default
    # shrinks them layer by layer, so a fresh AlexNet barely learns for the first epoch); a
    # small last layer starts the logits near uniform, the loss near log(num_classes).
    weighted = [m for m in model if isinstance(m, nn.Conv2d | nn.Linear)]
    for module in weighted:
        nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    nn.init.normal_(weighted[-1].weight, std=0.01)


def _paper_lrn() -> nn.LocalResponseNorm:
    # Paper: n=5, k=2, alpha=1e-4, beta=0.75 with alpha not divided by n; torch divides.
    return nn.LocalResponseNorm(5, alpha=5 * 1e-4, beta=0.75, k=2.0)


def _tower_features() -> list[nn.Module]:
    return [
        nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.AdaptiveAvgPool2d((6, 6)),
        nn.Flatten(1),
    ]


def _tower_classifier(num_classes: int, hidden: int, dropout: float) -> list[nn.Module]:
    return [
        nn.Dropout(dropout),
        nn.Linear(256 * 6 * 6, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    ]


def _paper_features() -> list[nn.Module]:
    return [
        nn.Conv2d(3, 96, kernel_size=11, stride=4, padding=2),
        nn.ReLU(inplace=True),
        _paper_lrn(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(96, 256, kernel_size=5, padding=2, groups=2),
        nn.ReLU(inplace=True),
        _paper_lrn(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(256, 384, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, kernel_size=3, padding=1, groups=2),
        nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, kernel_size=3, padding=1, groups=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.AdaptiveAvgPool2d((6, 6)),
        nn.Flatten(1),
    ]


def _paper_classifier(num_classes: int, hidden: int, dropout: float) -> list[nn.Module]:
    return [
        nn.Linear(256 * 6 * 6, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    ]
