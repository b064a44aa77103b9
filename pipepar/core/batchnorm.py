"""Deferred batch norm: running statistics over the whole mini-batch, not each micro-batch.

With ``chunks=m`` a batch-norm layer sees m small batches per step, so it would update its
running mean and variance m times, each from a noisy fraction of the batch. Deferring keeps the
layer as it is: its class, its forward and whatever that forward does around the batch norm
(timm's ``BatchNormAct2d`` applies its activation after it) run unchanged, and ``state_dict``
keys stay the model's. :func:`defer_statistics` hooks every batch-norm layer that keeps running
statistics (``nn.modules.batchnorm._BatchNorm`` and its subclasses). While a mini-batch is open
(:func:`committing`), a training forward of such a layer sees its running buffers watched (a
tensor subclass sharing their memory, swapped in for that forward only), which catches the
layer's batch-norm call on them: the call still normalizes with the micro-batch's statistics
(what the layer computes in training) but updates nothing, and the micro-batch's per-channel
mean and variance are accumulated instead. When the mini-batch ends they are folded in once,
with the momentum the layer's forward passed to its first call and the batch counter as its
first forward left it: what the layer tracks on the whole mini-batch.

What the layer does is read from its forward, not assumed: a forward that may write into its
running buffers any other way while training (updates them itself in place, hands them to
another normalization kernel) cannot be deferred exactly, and raises a ``ValueError`` naming the
layer and the ways out; reading them (their shape, a copy) is left alone.
Outside a mini-batch (the plain model called directly) the hooks change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pipepar.core.forms import writes_in_place
from pipepar.core.recompute import is_recomputing

__all__ = [
    "commit_all",
    "committing",
    "defer_statistics",
    "deferred",
    "reset_all",
    "watched_as_before",
]

_ATTRIBUTE = "_pipepar_deferred_statistics"

# The batch-norm functions a forward may call, with their arguments' names in order.
_F_NAMES: tuple[str, ...] = (
    "input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps",
)  # fmt: skip
_F_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
_TORCH_NAMES = (
    "input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
    "cudnn_enabled",
)  # fmt: skip


class _Statistics:
    """What one layer gathered in the open mini-batch (a plain attribute: never saved)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.open = False
        self.hooks: list[RemovableHandle] = []
        self.counter_before: Tensor | None = None  # taken when a mini-batch opens
        self.clear()

    def clear(self) -> None:
        """Forget what the forwards gathered (the counter at the start is kept)."""
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None
        self.momentum = 0.0
        self.counter_after: Tensor | None = None

    def add(self, input: Tensor, momentum: float) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach()
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n = x.numel() // x.shape[1]
        # One call of a layer at a time: a stage runs its micro-batches in turn.
        if self.count == 0 or self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2, self.momentum = n, mean, var * n, momentum
            return
        # Chan et al.'s pairwise update: exact and stable for any split of the batch.
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + var * n + delta.square() * (self.count * n / total)
        self.count = total


def defer_statistics(model: nn.Module, on: bool = True) -> None:
    """Hook every batch-norm layer of ``model`` (itself included) that keeps running
    statistics, so that inside :func:`committing` they are updated once per mini-batch; with
    ``on=False`` take such hooks away (a model wrapped again without deferring). Classes,
    forwards and ``state_dict`` keys stay as they are; hooking twice is once.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> defer_statistics(model)
        >>> with committing([model]):
        ...     for part in torch.randn(8, 4).chunk(4):
        ...         _ = model(part)
        >>> int(model[1].num_batches_tracked)
        1
    """
    for path, sub in model.named_modules():
        stats = deferred(sub)
        if on and stats is None and _deferrable(sub):
            stats = _Statistics(path or "the model")
            stats.hooks = [
                sub.register_forward_pre_hook(_before),
                sub.register_forward_hook(_after, always_call=True),
            ]
            setattr(sub, _ATTRIBUTE, stats)
        elif not on and stats is not None:
            for hook in stats.hooks:
                hook.remove()
            delattr(sub, _ATTRIBUTE)


def deferred(module: nn.Module) -> _Statistics | None:
    """The statistics ``module`` defers, or None if :func:`defer_statistics` did not hook it."""
    stats = module.__dict__.get(_ATTRIBUTE)
    return stats if isinstance(stats, _Statistics) else None


def _deferrable(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and not isinstance(module, nn.SyncBatchNorm)  # its replicas keep statistics together
        and module.track_running_stats
    )


@contextmanager
def committing(
    modules: Sequence[nn.Module], *, dropping: Sequence[nn.Module] = ()
) -> Iterator[None]:
    """One mini-batch of ``modules``: their deferred batch norms gather statistics in the
    block and commit them when it ends; if it fails, what they gathered is dropped and their
    counters put back (a failed step must not count towards the next). Those in
    ``dropping`` and not in ``modules`` (another rank's stages, run here to follow the model's
    code) are left as they were either way."""
    kept = _found(modules)
    own = {id(m) for m, _ in kept}
    dropped = [(m, stats) for m, stats in _found(dropping) if id(m) not in own]
    for module, stats in kept + dropped:
        stats.open = True
        counter = module.num_batches_tracked
        if stats.counter_before is None and isinstance(counter, Tensor):
            stats.counter_before = counter.detach().clone()
    try:
        yield
    except BaseException:
        _each(kept, _reset)
        raise
    else:
        _each(kept, _commit)
    finally:
        _each(dropped, _reset)
        for _, stats in kept + dropped:
            stats.open, stats.counter_before = False, None


@contextmanager
def watched_as_before(module: nn.Module) -> Iterator[None]:
    """A recompute that runs ``module``'s forward without calling the module (torch's
    checkpoint of a unit's forward) sees its running buffers as its first run did; enter it
    inside :func:`pipepar.core.recompute.recomputing_as_before`."""
    _before(module, ())
    try:
        yield
    finally:
        _after(module, (), None)


def commit_all(modules: Sequence[nn.Module]) -> None:
    """Fold what every deferred batch norm in ``modules`` gathered into its running statistics."""
    _each(_found(modules), _commit)


def reset_all(modules: Sequence[nn.Module]) -> None:
    """Drop what every deferred batch norm in ``modules`` gathered since its last commit."""
    _each(_found(modules), _reset)


def _found(modules: Sequence[nn.Module]) -> list[tuple[nn.Module, _Statistics]]:
    found: dict[int, tuple[nn.Module, _Statistics]] = {}
    for module in modules:
        for sub in module.modules():
            stats = deferred(sub)
            if stats is not None:
                found.setdefault(id(sub), (sub, stats))
    return list(found.values())


def _each(
    found: list[tuple[nn.Module, _Statistics]], fn: Callable[[nn.Module, _Statistics], None]
) -> None:
    for module, stats in found:
        fn(module, stats)


@torch.no_grad()
def _commit(module: nn.Module, stats: _Statistics) -> None:
    """Fold the mini-batch's statistics in, as the layer would from one call on all of it:
    the unbiased variance, the momentum its forward passed, its counter after one forward."""
    mean, var = module.running_mean, module.running_var
    if stats.count and stats.mean is not None and stats.m2 is not None:
        if isinstance(mean, Tensor):
            mean.lerp_(stats.mean.to(mean.dtype), stats.momentum)
        if isinstance(var, Tensor):
            unbiased = stats.m2 / max(stats.count - 1, 1)
            var.lerp_(unbiased.to(var.dtype), stats.momentum)
    _set_counter(module, stats.counter_after)
    stats.clear()


@torch.no_grad()
def _reset(module: nn.Module, stats: _Statistics) -> None:
    _set_counter(module, stats.counter_before)
    stats.clear()


def _set_counter(module: nn.Module, value: Tensor | None) -> None:
    counter = module.num_batches_tracked
    if isinstance(counter, Tensor) and value is not None and not (counter.is_meta or value.is_meta):
        counter.copy_(value)


# -- the hooks: a training forward inside an open mini-batch sees its buffers watched ----------
_BUFFERS = ("running_mean", "running_var")


def _before(module: nn.Module, args: Any) -> None:
    stats = deferred(module)
    if stats is None or not (module.training and module.track_running_stats):
        return
    if not (stats.open or is_recomputing()):  # a recompute runs as the first forward did
        return
    for name in _BUFFERS:
        buffer = module._buffers.get(name)
        if buffer is not None and not isinstance(buffer, _Watched):
            module._buffers[name] = _Watched.of(buffer, module, stats)


def _after(module: nn.Module, args: Any, output: Any) -> None:
    stats = deferred(module)
    watched = [name for name in _BUFFERS if isinstance(module._buffers.get(name), _Watched)]
    if stats is None or not watched:
        return
    for name in watched:
        module._buffers[name] = module._buffers[name].plain  # type: ignore[union-attr]
    counter = module.num_batches_tracked
    if stats.counter_after is None and isinstance(counter, Tensor) and not is_recomputing():
        stats.counter_after = counter.detach().clone()


class _Watched(Tensor):
    """A deferred layer's running buffer while the layer runs a training forward in an open
    mini-batch: the batch-norm call it goes to normalizes with the micro-batch's statistics
    and updates nothing (they are gathered); reads run as usual, any other write is refused."""

    plain: Tensor
    module: nn.Module
    stats: _Statistics

    @staticmethod
    def of(buffer: Tensor, module: nn.Module, stats: _Statistics) -> _Watched:
        watched = Tensor._make_subclass(_Watched, buffer, False)
        watched.plain, watched.module, watched.stats = buffer, module, stats
        return watched

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        call = _batch_norm_call(func, args, kwargs)
        if call is not None and call["training"] and isinstance(call["running_mean"], _Watched):
            return _deferred_call(call, call["running_mean"].stats)
        if (call is not None and not call["training"]) or not _may_write(func, kwargs):
            with torch._C.DisableTorchFunctionSubclass():  # reads the running statistics
                return func(*args, **kwargs)
        owner = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, _Watched))
        raise _cannot_keep(owner.module, owner.stats.path, func)


def _may_write(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` may write into a tensor it is given: an in-place method (``add_``),
    an in-place operator (``+=``, ``t[:] = v``), an ``out=`` argument, or a normalization kernel
    that updates running statistics."""
    name = getattr(func, "__name__", "")
    return writes_in_place(func) or "out" in kwargs or "norm" in name


def _deferred_call(call: dict[str, Any], stats: _Statistics) -> Tensor:
    """The batch-norm call without its running statistics; the input's gathered."""
    if not is_recomputing():
        stats.add(call["input"], float(call["momentum"]))
    return F.batch_norm(
        call["input"], None, None, call["weight"], call["bias"], True, 0.0, call["eps"]
    )


def _batch_norm_call(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The arguments of a call of ``F.batch_norm`` or ``torch.batch_norm`` by name; None for
    any other function."""
    if func is F.batch_norm:
        names, call = _F_NAMES, dict(_F_DEFAULTS)
    elif func is torch.batch_norm:
        names, call = _TORCH_NAMES, {}
    else:
        return None
    call.update(zip(names, args))
    call.update(kwargs)
    return call


def _cannot_keep(module: nn.Module, path: str, func: Any) -> ValueError:
    name = getattr(func, "__name__", repr(func))
    return ValueError(
        f"deferred_batch_norm=True cannot defer the running statistics of {path!r} "
        f"({type(module).__qualname__}): while training its forward may write into running_mean "
        f"or running_var through {name}, not only its batch-norm call, so they would differ from "
        "the plain model's; pass deferred_batch_norm=False (statistics per micro-batch) or "
        "chunks=1"
    )
