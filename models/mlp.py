"""The benchmark model, as installed users get it: :mod:`pipepar.zoo.mlp`."""

from pipepar.zoo.mlp import mlp

__all__ = ["mlp"]
