"""Sequential model zoo: every builder returns a flat ``nn.Sequential`` ready to split.

The repository's zoo, for the tests, examples and benchmarks: it is not installed with pipepar.
The models installed users get (:func:`alexnet`, :func:`gpt`, :func:`mlp`) live in
:mod:`pipepar.zoo` and are the same functions here.

Each builder takes keyword-only options and ``device=`` (``"meta"`` builds without memory):

- :func:`alexnet`: torchvision's AlexNet, or ``original=True`` for the 2012 two-GPU net.
- :func:`vgg16` / :func:`vgg`: VGG-11/13/16/19, optionally with batch norm.
- :func:`resnet50` / :func:`resnet`: ResNet-18...152, stem layers then one layer per block.
- :func:`gpt`: GPT-style decoder, token ids -> embedding -> blocks -> norm -> logits.
- :func:`mlp`: ``depth`` x (Linear + ReLU), the benchmark model.
- :func:`convnet`: a small conv / batch-norm / dropout classifier for tests and planning.

    >>> import models
    >>> model = models.get("resnet50", num_classes=10, device="meta")
    >>> len(model)
    23
"""

from models.alexnet import alexnet
from models.convnet import convnet
from models.gpt import gpt
from models.mlp import mlp
from models.registry import get, names
from models.resnet import resnet, resnet50
from models.vgg import vgg, vgg16

__all__ = ["alexnet", "convnet", "get", "gpt", "mlp", "names", "resnet", "resnet50", "vgg", "vgg16"]
