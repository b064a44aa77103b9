"""Deferred batch norm: running statistics over the whole mini-batch, not each micro-batch.

With ``chunks=m`` a batch-norm layer sees m small batches per step, so plain ``nn.BatchNorm*``
would update its running mean and variance m times, each from a noisy fraction of the batch.
:class:`DeferredBatchNorm` still normalizes every micro-batch with its own statistics (that is
what the layer computes in training), but only accumulates the per-channel mean and variance,
and folds them into the running statistics once the mini-batch is complete (:meth:`commit`). The
result equals what the plain layer would have tracked on the whole mini-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipepar.core.recompute import is_recomputing

__all__ = [
    "DeferredBatchNorm",
    "commit_all",
    "committing",
    "convert_deferred_batch_norm",
    "convert_inside",
    "reset_all",
]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A batch-norm layer whose running statistics are updated once per mini-batch.

    It has the same parameters and buffers (and so the same ``state_dict`` keys) as the
    ``nn.BatchNorm1d/2d/3d`` it replaces. Accumulators are plain attributes, never saved.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def reset_accumulators(self) -> None:
        """Forget the statistics gathered since the last commit."""
        self._count = 0
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    def _accumulate(self, input: Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach()
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n = x.numel() // x.shape[1]
        count = getattr(self, "_count", 0)
        if count == 0 or self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = n, mean, var * n
            return
        # Chan et al.'s pairwise update: exact and stable for any split of the batch.
        total = count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + var * n + delta.square() * (count * n / total)
        self._count = total

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if not is_recomputing():
            with torch._C.DisableTorchFunction():  # pipepar's bookkeeping, not the model's
                self._accumulate(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running statistics."""
        if getattr(self, "_count", 0) == 0 or self._mean is None or self._m2 is None:
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        tracked = float(self.num_batches_tracked)
        factor = 1.0 / tracked if self.momentum is None else self.momentum
        unbiased = self._m2 / max(self._count - 1, 1)
        self.running_mean.lerp_(self._mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        self.reset_accumulators()

    @classmethod
    def from_batch_norm(cls, bn: nn.modules.batchnorm._BatchNorm) -> DeferredBatchNorm:
        """A deferred twin of ``bn`` sharing its parameters and buffers."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            setattr(new, attr, getattr(bn, attr))
        for name, param in bn.named_parameters(recurse=False):
            new.register_parameter(name, param)
        for name, buf in bn.named_buffers(recurse=False):
            new.register_buffer(name, buf)
        new.training = bn.training
        new.reset_accumulators()
        return new


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every tracking ``nn.BatchNorm*`` inside ``module`` by a :class:`DeferredBatchNorm`.

    Returns ``module`` itself (or the replacement when ``module`` is a batch norm).
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, (DeferredBatchNorm, nn.SyncBatchNorm)
    ):
        return DeferredBatchNorm.from_batch_norm(module) if module.track_running_stats else module
    for name, child in module.named_children():
        new = convert_deferred_batch_norm(child)
        if new is not child:
            setattr(module, name, new)
    return module


def convert_inside(model: nn.Module) -> None:
    """Replace every tracking batch norm inside ``model`` (in place) by a deferred one."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        raise TypeError(
            f"deferred_batch_norm=True replaces the batch-norm layers inside the model, and the "
            f"model is one ({type(model).__name__}); wrap the model that holds it"
        )
    convert_deferred_batch_norm(model)


@contextmanager
def committing(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Commit the deferred batch norms in ``modules`` when the block (one mini-batch) ends;
    drop what they gathered if it fails (a failed step must not count towards the next)."""
    try:
        yield
    except BaseException:
        reset_all(list(modules))
        raise
    commit_all(list(modules))


def commit_all(modules: list[nn.Module]) -> None:
    """Commit every deferred batch norm found in ``modules``."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, DeferredBatchNorm):
                sub.commit()


def reset_all(modules: list[nn.Module]) -> None:
    """Drop what every deferred batch norm in ``modules`` gathered since its last commit."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, DeferredBatchNorm):
                sub.reset_accumulators()
