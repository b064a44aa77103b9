"""The GPT-style ``nn.Sequential``, as installed users get it: :mod:`pipepar.zoo.gpt`."""

from pipepar.zoo.gpt import Block, Embedding, gpt

__all__ = ["Block", "Embedding", "gpt"]
