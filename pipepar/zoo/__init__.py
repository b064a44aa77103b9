"""Example models that come with pipepar, for the documentation and the command line.

Each builder makes a model with random weights from sizes alone (nothing is downloaded) and
takes ``device=`` (``"meta"`` builds without memory):

- :func:`alexnet`: AlexNet as a flat ``nn.Sequential`` (torchvision's layout, or the 2012
  two-GPU net with ``original=True``).
- :func:`mlp`: ``depth`` x (Linear + ReLU), a flat ``nn.Sequential``.
- :func:`gpt`: a GPT-style decoder as a flat ``nn.Sequential``.
- :func:`llama`, :func:`llama3_70b`: transformers' ``LlamaForCausalLM`` from sizes, and the
  shape of Llama 3 70B (needs ``pipepar[hf]``).

On the command line they are ``pipepar.zoo:NAME``, e.g.
``pipepar plan pipepar.zoo:llama3_70b --tokens 8,4096 ...``; a model of one's own is
``package.module:function``.

    >>> from pipepar import zoo
    >>> len(zoo.mlp(depth=2, width=8, device="meta"))
    4
"""

from pipepar.zoo.alexnet import alexnet
from pipepar.zoo.gpt import gpt
from pipepar.zoo.llama import llama, llama3_70b
from pipepar.zoo.mlp import mlp

__all__ = ["alexnet", "gpt", "llama", "llama3_70b", "mlp"]
