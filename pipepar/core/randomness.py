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

The dispatch mode costs about 10 us of Python per operator. A :class:`DrawLog` kept by the pipe
across mini-batches lets a stage that is known to draw nothing skip it: a stage's forwards run
under the mode for a mini-batch with its layers' current train/eval flags; if none drew, the
stage is *quiet* under those flags and its forwards in later mini-batches that will not be
recomputed run without it. The mini-batch checks that no generator moved between its first
quiet forward and its end (:meth:`Streams.close`; pipepar's own seed draw excepted). If one did
(randomness that depends on something other than the train/eval flags), some quiet forward drew
from the shared generator as the plain model does, a ``RuntimeWarning`` says so once, and every
stage that ran quiet in that mini-batch is watched again. A forward that will be recomputed
always runs under the mode, so a recompute replays exactly.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Hashable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DrawLog", "DrawPoint", "Randomness", "Recorded", "Streams", "draw_point"]

_SEEDED = torch.Tag.nondeterministic_seeded
_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
_streaming = threading.local()  # .mode: the stream this thread draws from, if any
_NOTHING: AbstractContextManager[None] = nullcontext()
"""A context with nothing to do (reentrant: shared by every block that needs none)."""


def _lock(device: torch.device) -> threading.Lock:
    key = (device.type, device.index or 0)
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


_CPU_LOCK = _lock(torch.device("cpu"))  # found once


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class Randomness(Protocol):
    """How a stage's random operators draw: ``with r.drawing(stage, microbatch): ...``.

    ``replay``: the block will run again (a recompute) and must draw the same numbers.
    ``flags``: the stage's layers' train/eval flags (what decides whether they draw).
    """

    def drawing(
        self, stage: int, microbatch: int, *, replay: bool = True, flags: Hashable = ()
    ) -> AbstractContextManager[None]: ...

    def close(self) -> None:
        """The mini-batch's blocks have all run (it may check what they did)."""


class DrawLog:
    """Which stages drew random numbers, per train/eval flags, over the forwards seen so far.

    A pipe keeps one across mini-batches. A stage is *quiet* under some flags once a forward
    ran with those flags under the dispatch mode and drew nothing, and none has drawn since.

    Example:
        >>> log = DrawLog()
        >>> log.quiet(0, (True,))
        False
        >>> log.saw(0, (True,), drew=False)
        >>> log.quiet(0, (True,)), log.any_drew()
        (True, False)
    """

    def __init__(self) -> None:
        self._drew: dict[tuple[int, Hashable], bool] = {}

    def quiet(self, stage: int, flags: Hashable) -> bool:
        """True if the stage is known to draw nothing under ``flags``."""
        return self._drew.get((stage, flags)) is False

    def saw(self, stage: int, flags: Hashable, *, drew: bool) -> None:
        """Record a forward of ``stage`` under ``flags`` that did or did not draw."""
        key = (stage, flags)
        self._drew[key] = drew or self._drew.get(key, False)

    def any_drew(self) -> bool:
        """True if some stage has drawn under some flags."""
        return any(self._drew.values())

    def quiet_now(self) -> frozenset[tuple[int, Hashable]]:
        """The (stage, flags) known to be quiet at this moment."""
        return frozenset(key for key, drew in self._drew.items() if not drew)


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
    def drawing(
        self, stage: int, microbatch: int, *, replay: bool = True, flags: Hashable = ()
    ) -> Iterator[None]:
        """Record the generator states the block's random operators start from, or replay
        them if this (stage, micro-batch) ran before; a block that will not run again
        (``replay=False``) draws as the plain model does, with nothing to record."""
        key = (stage, microbatch)
        if not replay and key not in self._states:
            yield
            return
        if key in self._states:
            mode: _DrawMode = _ReplayMode(self._states[key])
        else:
            mode = _RecordMode(self._states.setdefault(key, []))
        with mode:
            yield

    def close(self) -> None:
        """Nothing to check: the blocks drew as the plain model does."""


class _DrawMode(TorchDispatchMode):
    """Sends every operator that draws from a generator to :meth:`draw`; the rest run as is.
    ``drew`` tells whether any did."""

    drew = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _SEEDED not in func.tags or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        self.drew = True
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

    def __init__(
        self,
        seed: int | None = None,
        *,
        log: DrawLog | None = None,
        flags: Mapping[int, Hashable] | None = None,
    ) -> None:
        self._seed = seed
        self._guard = threading.Lock()
        self._watch = _QuietWatch()
        self.log = log
        # Decided per mini-batch: a stage found quiet during this one is trusted from the
        # next one on, when every stage that draws takes its seed before any stage runs.
        self._quiet = log.quiet_now() if log is not None else frozenset()
        if log is not None and log.any_drew() and self._checked_beside_drawing(flags):
            # Draw the seed now, while no stage runs: a quiet stage's check must not see the
            # shared generator move under it.
            self.seed()

    def _checked_beside_drawing(self, flags: Mapping[int, Hashable] | None) -> bool:
        """Whether a stage runs quiet (checked) while another may draw, given each stage's
        train/eval ``flags`` (unknown: assume so). If all are quiet (an evaluation in eval
        mode) or none is, the seed waits for a random operator: with none, the generator is
        left untouched, as the plain model leaves it."""
        if flags is None or self.log is None:
            return True
        checked = [(s, f) in self._quiet and self.log.quiet(s, f) for s, f in flags.items()]
        return any(checked) and not all(checked)

    def seed(self) -> int:
        """The mini-batch's seed (drawn on first use)."""
        with self._guard:
            if self._seed is None:
                with _CPU_LOCK:
                    before = _cpu_state()
                    self._seed = int(torch.randint(2**62, ()))
                    # a known move of the generator: quiet blocks running now did not draw it
                    _WATCH.rebase(before, _cpu_state())
            return self._seed

    def drawing(
        self, stage: int, microbatch: int, *, replay: bool = True, flags: Hashable = ()
    ) -> AbstractContextManager[None]:
        """Run the block's random operators on stream (stage, micro-batch), from its start
        (so a recompute draws what the first forward drew). A stage the log knows to be quiet
        under ``flags`` runs a block that will not be replayed without the mode, checked
        (entered at once: the context then has nothing left to do, and costs nothing)."""
        log, key = self.log, (stage, flags)
        if log is not None and not replay and key in self._quiet and log.quiet(*key):
            # quiet before this mini-batch, and not found drawing since: checked at close()
            self._watch.add(stage, flags)
            return _NOTHING
        return self._stream(stage, microbatch, flags)

    @contextmanager
    def _stream(self, stage: int, microbatch: int, flags: Hashable) -> Iterator[None]:
        """The block under the stream's mode; the log told whether it drew."""
        mode = _StreamMode(self, 1_000_003 * stage + microbatch)
        with _drawing_from(mode):
            yield
        if self.log is not None:
            self.log.saw(stage, flags, drew=mode.drew)

    def close(self) -> None:
        """After the mini-batch's blocks: check that no generator moved while its quiet
        blocks ran (see the module docstring). A block that runs later opens a new check."""
        if self.log is not None:
            self._watch.close(self.log)


@contextmanager
def _drawing_from(mode: _StreamMode) -> Iterator[None]:
    """Enter ``mode``, known to :func:`draw_point` on this thread while it is entered."""
    outer = getattr(_streaming, "mode", None)
    _streaming.mode = mode
    try:
        with mode:
            yield
    finally:
        _streaming.mode = outer


class DrawPoint:
    """Where this thread's random draws stand at one moment; :meth:`replaying` draws again
    from there. Take one with :func:`draw_point`.

    Inside :meth:`Streams.drawing` the point is a position in the block's stream (the
    recompute of a part of the block draws what that part drew, whatever the block drew
    before it); elsewhere it is the state of the default generators (CPU, and each CUDA
    generator in use), which :meth:`replaying` sets and puts back after.

    Example:
        >>> point = draw_point()
        >>> a = torch.rand(2)
        >>> with point.replaying():
        ...     b = torch.rand(2)
        >>> bool((a == b).all())
        True
    """

    def __init__(self) -> None:
        mode: _StreamMode | None = getattr(_streaming, "mode", None)
        self._stream = None if mode is None else (mode.streams, mode.offset, dict(mode.states))
        self._generators = (
            None if mode is not None else [(g, g.get_state()) for g in _generators_in_use()]
        )

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Draw from this point during the block."""
        if self._stream is not None:
            streams, offset, states = self._stream
            mode = _StreamMode(streams, offset)
            mode.states = dict(states)
            with mode:
                yield
            return
        assert self._generators is not None
        saved = [(g, g.get_state()) for g, _ in self._generators]
        for g, state in self._generators:
            g.set_state(state)
        try:
            yield
        finally:
            for g, state in saved:
                g.set_state(state)


def draw_point() -> DrawPoint:
    """Where this thread's random draws stand now (see :class:`DrawPoint`)."""
    return DrawPoint()


def _generators_in_use() -> list[torch.Generator]:
    gens = [torch.default_generator]
    if torch.cuda.is_initialized():
        gens.extend(torch.cuda.default_generators)
    return gens


@dataclass
class _Window:
    """One mini-batch's quiet blocks so far: the generators' states they started from, and
    each quiet stage's train/eval flags."""

    start: list[bytes]
    stages: dict[int, Hashable] = field(default_factory=dict)
    moved: bool = False  # a generator moved before pipepar drew a seed (see _Watch.rebase)


class _Watch:
    """The windows open now, in every pipe of the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[int, _Window] = {}
        self.keys = itertools.count()

    def opened(self, window: _Window) -> int:
        with self.lock:
            key = next(self.keys)
            self.open[key] = window
            return key

    def closed(self, key: int) -> _Window:
        with self.lock:
            return self.open.pop(key)

    def rebase(self, before: bytes, after: bytes) -> None:
        """pipepar moved the CPU generator itself, from ``before`` to ``after``: a window
        that started elsewhere saw a draw before this one; every window compares with
        ``after`` from now on."""
        with self.lock:
            for window in self.open.values():
                window.moved = window.moved or window.start[0] != before
                window.start[0] = after


_WATCH = _Watch()


class _QuietWatch:
    """The watch of one mini-batch's quiet blocks (see :class:`Streams`): the generators'
    states are read when its first quiet block starts and when the mini-batch ends
    (:meth:`close`), not around every block; each read takes a copy of every generator's
    state, and in a pipe two per block held the interpreter lock longer than the rest of a
    quiet block's bookkeeping."""

    def __init__(self) -> None:
        self._key: int | None = None
        self._guard = threading.Lock()
        self._added: set[int] = set()
        """The stages the open window lists already (their later blocks add nothing)."""

    def add(self, stage: int, flags: Hashable) -> None:
        """A quiet block of ``stage`` (under ``flags``) starts."""
        if stage in self._added:  # the window lists it, with the flags of its first block
            return
        with self._guard:
            if self._key is None:
                with _CPU_LOCK:  # read in order with any seed draw
                    start = _fingerprints(locked_cpu=True)
                self._key = _WATCH.opened(_Window(start))
            window = _WATCH.open[self._key]
            window.stages.setdefault(stage, flags)
            self._added.add(stage)

    def close(self, log: DrawLog) -> None:
        """After the mini-batch's blocks: if a generator moved since the first quiet block
        (other than by pipepar's own seed), one of the quiet stages drew; ``log`` watches them
        all again, and a warning says so."""
        with self._guard:
            key, self._key = self._key, None
            self._added = set()
        if key is None:
            return
        with _CPU_LOCK:
            end = _fingerprints(locked_cpu=True)
            window = _WATCH.closed(key)
        if end == window.start and not window.moved:
            return
        for stage, flags in window.stages.items():
            log.saw(stage, flags, drew=True)
        named = " or ".join(str(s) for s in sorted(window.stages))
        warnings.warn(
            f"pipepar: stage {named} drew random numbers in a forward although its earlier "
            "forwards with the same train/eval flags drew none; such a forward drew from the "
            "shared generator (not repeatable from run to run), later ones use the stage's "
            "own random streams",
            RuntimeWarning,
            stacklevel=3,
        )


def _state_bytes(generator: torch.Generator) -> bytes:
    """``generator``'s state as bytes, read past any torch function mode: a model's stage may
    run under one that moves every tensor it sees (onto the stage's GPU, say), the state too."""
    with torch._C.DisableTorchFunction():
        return generator.get_state().numpy().tobytes()


def _cpu_state() -> bytes:
    return _state_bytes(torch.default_generator)


def _fingerprints(*, locked_cpu: bool = False) -> list[bytes]:
    """The states of the CPU generator and of every initialized CUDA generator, each read
    under its lock (a stream swaps its own state in only while holding it); ``locked_cpu``:
    the caller holds the CPU generator's lock already."""
    states = [_cpu_state()] if locked_cpu else []
    if not locked_cpu:
        with _CPU_LOCK:
            states.append(_cpu_state())
    if torch.cuda.is_initialized():  # never without a device (cheaper than is_available)
        for k, gen in enumerate(torch.cuda.default_generators):
            with _lock(torch.device("cuda", k)):
                states.append(_state_bytes(gen))
    return states


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
