"""AlexNet, as installed users get it: :mod:`pipepar.zoo.alexnet`."""

from pipepar.zoo.alexnet import alexnet

__all__ = ["alexnet"]
