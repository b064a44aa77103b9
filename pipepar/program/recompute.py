"""Recompute (activation checkpointing) for any model, one unit at a time.

A stage that recomputes a micro-batch (``checkpoint="always"``, or every micro-batch but the
last with ``"except_last"``) runs each of its units under torch's non-reentrant checkpoint
(:func:`torch.utils.checkpoint.checkpoint`): the forward keeps the unit's arguments and drops
what the unit's operations saved for backward; the backward runs the unit again to get them
back. The model's own code between units (an embedding sum, a reshape, the loss) keeps its
activations as usual.

The recomputed unit sees what its first run saw:

- **the same random numbers**: the unit starts from a :class:`~pipepar.core.randomness.DrawPoint`
  of the micro-batch's random stream taken when it first ran, and its recompute draws from
  there (torch's own RNG saving is off: the pipe's streams are not the default generator,
  and several stages draw at once);
- **the same weights**: a weight tied to an earlier stage's (held there, used here through a
  stand-in leaf) is the stand-in again;
- **the same argument objects**: an object the first run changed (a key-value cache its layer
  appended to) is given to the recompute as it was before
  (:mod:`pipepar.program.argument_states`);
- **batch-norm statistics updated once**: the running statistics are put back as the first
  run left them (:func:`pipepar.core.recompute.recomputing_as_before`).

Which stage recomputes is decided per stage and micro-batch by the stage's step, which enters
:func:`recomputing_units` around that stage's stretch of the forward. A micro-batch whose
recompute the schedule lists as an ``R`` action runs its units as
:class:`~pipepar.program.unit_calls.UnitCall` instead of under torch's checkpoint: the same
recompute in the same contexts, run when the ``R`` comes rather than when the backward first
reads what a unit saved.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipepar.core.batchnorm import watched_as_before
from pipepar.core.randomness import DrawPoint, draw_point
from pipepar.core.recompute import recomputing_as_before
from pipepar.program.argument_states import replaying
from pipepar.program.driver import unit_lock
from pipepar.program.unit_calls import UnitCall, UnitCalls

__all__ = ["checkpoint_units", "recomputing_units"]

_local = threading.local()


@contextlib.contextmanager
def recomputing_units(on: bool, into: UnitCalls | None = None) -> Iterator[None]:
    """While entered on this thread, units made by :func:`checkpoint_units` run checkpointed
    (``on``) or as usual; checkpointed, under torch's checkpoint (recomputed when the backward
    reads what they saved), or with ``into``, as calls noted there (recomputed when
    :meth:`UnitCalls.recompute` is called, else when the backward reads them)."""
    outer = getattr(_local, "on", False), getattr(_local, "into", None)
    _local.on, _local.into = on, into
    try:
        yield
    finally:
        _local.on, _local.into = outer


def checkpoint_units(modules: Sequence[nn.Module]) -> None:
    """Let each module's forward run checkpointed inside :func:`recomputing_units` (once per
    module, whatever the number of pipes built on it). Pass the units with weights: one
    without (an activation, a pooling) costs little to keep, and may write into its argument
    in place (``nn.ReLU(inplace=True)``), which a recompute cannot start from."""
    for module in modules:
        if not isinstance(module.forward, _Checkpointable):
            module.forward = _Checkpointable(module)


class _Checkpointable:
    """A module's forward that runs under torch's checkpoint inside
    :func:`recomputing_units`. An object, not a closure: a copy of the module
    (``copy.deepcopy``, pickling) gets one calling the copy's own forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        own = module.__dict__.get("forward")  # a forward set on the instance, if any
        self.inner: Callable[..., Any] | None = own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.inner or functools.partial(type(module).forward, module)
        if not getattr(_local, "on", False) or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        replay = _Replay(module)
        forward = replaying(forward, args, kwargs)  # a recompute sees the objects as they were
        given = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
        versions = _versions(given)
        into: UnitCalls | None = getattr(_local, "into", None)
        if into is not None:
            call = UnitCall(
                forward, args, kwargs, name=type(module).__name__, first=replay.first, again=replay
            )
            with recomputing_units(False):  # a unit inside it saves as its own operations
                out = into.run(call)
        else:
            out = checkpoint(
                forward,
                *args,
                use_reentrant=False,
                preserve_rng_state=False,
                context_fn=replay.contexts,
                **kwargs,
            )
        if _versions(given) != versions:
            raise ValueError(
                f"{type(module).__name__} writes into its own argument in place, so it cannot "
                "be recomputed from it; pass checkpoint='never', or make the layer write into "
                "a new tensor (e.g. inplace=False)"
            )
        return out


def _versions(tensors: Sequence[Tensor]) -> list[int]:
    """The tensors' version counters, read unseen by a subclass's ``__torch_function__`` (a
    tensor subclass may note every use of its tensors)."""
    with torch._C.DisableTorchFunctionSubclass():
        return [t._version for t in tensors]


class _Replay:
    """What one checkpointed unit call needs again when it is recomputed: its context for the
    first run, and one for each recompute (a backward split into input and weight gradients
    recomputes once for each)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.point: DrawPoint | None = None
        self.stand_ins: list[tuple[nn.Module, str, Tensor]] = []
        self._stacks: list[contextlib.ExitStack] = []

    def contexts(self) -> tuple[contextlib.AbstractContextManager[Any], _Replay]:
        return self.first(), self

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """Around the first run: note where the random draws stand and the stand-ins."""
        self.point = draw_point()
        self.stand_ins = []
        for m in self.module.modules():
            for name, t in m._parameters.items():
                if isinstance(t, Tensor) and not isinstance(t, nn.Parameter):
                    self.stand_ins.append((m, name, t))
        yield

    def __enter__(self) -> None:
        """Enter a recompute: the first run's stand-ins, random draws, and batch-norm
        statistics left alone."""
        assert self.point is not None
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as failing:
            failing.push(stack)
            if self.stand_ins:  # another stage may run the module now: not with these
                stack.enter_context(unit_lock(self.module))
            stack.enter_context(_swapped_in(self.stand_ins))
            stack.enter_context(self.point.replaying())
            stack.enter_context(recomputing_as_before([self.module]))
            stack.enter_context(watched_as_before(self.module))  # a deferred batch norm unit
            failing.pop_all()
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().__exit__(*exc)


@contextlib.contextmanager
def _swapped_in(stand_ins: Sequence[tuple[nn.Module, str, Tensor]]) -> Iterator[None]:
    """Put the stand-ins the first run used back in their modules for the block."""
    saved = [(m, name, m._parameters[name]) for m, name, _ in stand_ins]
    for m, name, t in stand_ins:
        m._parameters[name] = t  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p
