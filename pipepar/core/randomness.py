"""Random numbers that a recomputed forward sees again, whatever layer draws them.

A layer may draw random numbers anywhere in its forward: ``nn.Dropout``, ``F.dropout`` in a
custom forward, ``torch.rand_like`` masks, ``scaled_dot_product_attention(dropout_p=...)``, a
custom operator. A recomputed forward must see the same numbers, or its gradients are wrong; and
stage workers are threads that share the process-wide CPU generator, so without care the numbers
a stage gets would depend on thread timing.

:class:`Streams` gives each (stage, micro-batch) a random stream of its own. While a stage runs a
forward (or recomputes one) under :meth:`Streams.drawing`, a dispatch mode watches every operator
that torch tags as drawing from a generator (``torch.Tag.nondeterministic_seeded``) and runs it on
the stream's own generator state: the device's default generator is swapped to the stream's state
for that one operator, under a lock per generator, and swapped back after. A recompute replays the
stream from its start, so it draws exactly the same numbers, without any list of layer types.

Stages on different devices use different generators and never wait for each other; stages on
one device wait only for the duration of one random operator, not a whole forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Randomness", "Recorded", "Streams"]

_SEEDED = torch.Tag.nondeterministic_seeded
_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock(device: torch.device) -> threading.Lock:
    key = (device.type, device.index or 0)
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class Randomness(Protocol):
    """How a stage's random operators draw: ``with r.drawing(stage, microbatch): ...``."""

    def drawing(self, stage: int, microbatch: int) -> AbstractContextManager[None]: ...


class Recorded:
    """Draw from the default generators as the plain model would; a recompute replays.

    Example:
        >>> r = Recorded()
        >>> with r.drawing(0, 0):
        ...     a = torch.rand(3)
        >>> with r.drawing(0, 0):  # the recompute
        ...     b = torch.rand(3)
        >>> bool((a == b).all())
        True
    """

    def __init__(self) -> None:
        self._states: dict[tuple[int, int], list[tuple[torch.device, torch.Tensor]]] = {}

    @contextmanager
    def drawing(self, stage: int, microbatch: int) -> Iterator[None]:
        """Record the generator states the block's random operators start from, or replay
        them if this (stage, micro-batch) ran before."""
        key = (stage, microbatch)
        if key in self._states:
            mode: _DrawMode = _ReplayMode(self._states[key])
        else:
            mode = _RecordMode(self._states.setdefault(key, []))
        with mode:
            yield


class _DrawMode(TorchDispatchMode):
    """Sends every operator that draws from a generator to :meth:`draw`; the rest run as is."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _SEEDED not in func.tags or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        return self.draw(func, args, kwargs, _device_of(args, kwargs))

    def draw(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
    ) -> Any:
        raise NotImplementedError


class _RecordMode(_DrawMode):
    def __init__(self, states: list[tuple[torch.device, torch.Tensor]]) -> None:
        super().__init__()
        self.states = states

    def draw(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
    ) -> Any:
        self.states.append((device, _generator(device).get_state()))
        return func(*args, **kwargs)


class _ReplayMode(_DrawMode):
    def __init__(self, states: list[tuple[torch.device, torch.Tensor]]) -> None:
        super().__init__()
        self.states = iter(states)

    def draw(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
    ) -> Any:
        recorded, state = next(self.states, (None, None))
        if state is None or recorded != device:
            raise RuntimeError(
                "pipepar: a recomputed forward drew random numbers the first forward did not "
                "draw (the layer's randomness depends on something other than its input); "
                "use checkpoint='never' for this model"
            )
        generator = _generator(device)
        saved = generator.get_state()
        generator.set_state(state)
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(saved)


class Streams:
    """Random streams of one mini-batch: one per (stage, micro-batch), derived from one seed.

    The seed is drawn from the CPU generator the first time a random operator runs, so a
    mini-batch with nothing random leaves the caller's generator untouched, and
    ``torch.manual_seed`` before training makes the whole run repeat exactly.

    Example:
        >>> streams = Streams()
        >>> with streams.drawing(0, 0):
        ...     a = torch.rand(3)
        >>> with streams.drawing(0, 0):
        ...     b = torch.rand(3)
        >>> bool((a == b).all())
        True
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._guard = threading.Lock()

    def seed(self) -> int:
        """The mini-batch's seed (drawn on first use)."""
        with self._guard:
            if self._seed is None:
                with _lock(torch.device("cpu")):
                    self._seed = int(torch.randint(2**62, ()))
            return self._seed

    @contextmanager
    def drawing(self, stage: int, microbatch: int) -> Iterator[None]:
        """Run the block's random operators on stream (stage, micro-batch), from its start
        (so a recompute draws what the first forward drew)."""
        with _StreamMode(self, 1_000_003 * stage + microbatch):
            yield


class _StreamMode(_DrawMode):
    """Runs each seeded operator on this stream's generator state (swapped in under a lock)."""

    def __init__(self, streams: Streams, offset: int) -> None:
        super().__init__()
        self.streams, self.offset = streams, offset
        self.states: dict[torch.device, torch.Tensor] = {}

    def draw(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
    ) -> Any:
        seed = self.streams.seed() + self.offset if device not in self.states else 0
        generator = _generator(device)
        with _lock(device):
            saved = generator.get_state()
            if device in self.states:
                generator.set_state(self.states[device])
            else:
                generator.manual_seed(seed)
            try:
                return func(*args, **kwargs)
            finally:
                self.states[device] = generator.get_state()
                generator.set_state(saved)


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """False for a seeded operator that will not draw: dropout with p = 0, or a generator of the
    caller's own (``generator=`` given: the caller owns that stream)."""
    if kwargs.get("generator") is not None:
        return False
    for k, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p" or (arg.name == "p" and "dropout" in func.__name__):
            value = kwargs.get(arg.name, args[k] if k < len(args) else arg.default_value)
            return bool(value != 0)
    return True


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")
