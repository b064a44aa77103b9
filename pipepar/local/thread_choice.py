"""Who runs a one-process pipe's actions: its worker threads, or the calling thread.

Worker threads let stages compute at once: on two cores, two stages of large layers take about
half the time of one. But a worker holds Python's lock (the GIL) while it runs the Python
around each kernel, pipepar's and torch's, and lets go of it inside each kernel. Where every
action computes only microseconds (small layers, or a fast device's host), the workers mostly
wait for that lock and for each other, and hand it over at each kernel: a step takes longer
than the same actions run one after another on one thread (8 x Linear(64) on two cores: 1.25x
for 1F1B, 1.8x for ZB-V; ``benchmarks/bench_host_time.py``).

So a pipe whose stages are all on the CPU times both. For each kind of run (the phase of the
schedule, the schedule, training or not, a backward to follow or not) its first
:data:`WARMUP` calls run on the workers; the next alternate between the workers and the
calling thread until each has :data:`TRIALS` timings; from then on that kind runs on the
calling thread if its median was faster by :data:`MARGIN`, on the workers otherwise. Every
:data:`RECHECK` calls of the kind the trials run again (a machine busy with other work during
the first ones may have decided wrongly).

The calling thread runs the schedule's actions in its serial order, which never waits for an
input (:attr:`~pipepar.core.schedule.Schedule.serial`),
with the workers' count of math threads: each stage runs its own actions in its own list's
order, draws its random numbers from the same streams and splits each kernel's work as on its
worker, so the results are the same bits either way; only the time differs.

A pipe with a stage on an accelerator keeps its workers (its kernels run asynchronously, so a
call's time on the host does not say how long its device took). ``PIPEPAR_RUN_ON=workers`` or
``caller`` fixes the choice (:func:`pipepar.core.switches.run_on`).

Whatever the choice, a call made under a torch-function or dispatch mode of the caller's
(``FlopCounterMode``, a debugging or a quantizing mode; :func:`under_callers_mode`) runs on the
calling thread: a mode belongs to the thread that entered it, so the workers would run the
model's operations outside it (a FLOP count of a step on the workers was 0).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pipepar.core.callers_modes import CallersModes
from pipepar.core.switches import RUN_ON

__all__ = [
    "MARGIN",
    "RECHECK",
    "TRIALS",
    "WARMUP",
    "ThreadChoice",
    "choice_for",
    "under_callers_mode",
]

_log = logging.getLogger(__name__)

WARMUP = 2
"""Calls of a kind run on the workers, untimed, before the trials (a kind's first calls learn
its routes and allocate its buffers)."""
TRIALS = 3
"""Timed calls of a kind on each side."""
MARGIN = 1.1
"""How much faster the calling thread's median must be for a kind to leave the workers."""
RECHECK = 500
"""Calls of a kind run as chosen before its trials run again."""
_KINDS = 64  # kinds remembered; past that, the trials start over (a pipe fed ever new shapes)


@dataclass
class _Trials:
    """One kind's timings so far, and its choice once made (True: the calling thread)."""

    seen: int = 0
    workers: list[float] = field(default_factory=list)
    caller: list[float] = field(default_factory=list)
    choice: bool | None = None
    served: int = 0
    """Calls run as chosen since the choice."""


class ThreadChoice:
    """Per kind of run, whether the calling thread runs its actions instead of the workers.

    Args:
        mode: ``"auto"`` (time both), ``"workers"`` or ``"caller"`` (always that one).

    Example:
        >>> choice = ThreadChoice("auto")
        >>> for seconds in (9.0, 9.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0):  # warm-up, then trials
        ...     caller = choice.on_caller("F")
        ...     choice.took("F", caller, seconds)
        >>> choice.on_caller("F"), choice.chosen("F")
        (True, True)
    """

    def __init__(self, mode: str) -> None:
        if mode not in RUN_ON:
            raise ValueError(f"mode must be one of {', '.join(RUN_ON)}, but got {mode!r}")
        self.mode = mode
        self._kinds: dict[Hashable, _Trials] = {}

    def on_caller(self, kind: Hashable) -> bool:
        """Whether the next call of ``kind`` runs on the calling thread."""
        if self.mode != "auto":
            return self.mode == "caller"
        trials = self._kinds.get(kind)
        if trials is None:
            if len(self._kinds) >= _KINDS:
                self._kinds.clear()
            trials = self._kinds[kind] = _Trials()
        if trials.choice is not None:
            return trials.choice
        if trials.seen < WARMUP:
            return False
        return len(trials.caller) < len(trials.workers)  # the workers first, then in turns

    def took(self, kind: Hashable, caller: bool, seconds: float) -> None:
        """A call of ``kind`` ran (on the calling thread if ``caller``) in ``seconds``."""
        trials = self._kinds.get(kind)
        if trials is None:
            return
        if trials.choice is not None:
            trials.served += 1
            if trials.served >= RECHECK:  # time both again, past the warm-up
                self._kinds[kind] = _Trials(seen=WARMUP)
            return
        trials.seen += 1
        if trials.seen <= WARMUP:
            return
        (trials.caller if caller else trials.workers).append(seconds)
        if len(trials.caller) >= TRIALS and len(trials.workers) >= TRIALS:
            trials.choice = _faster_on_caller(trials.caller, trials.workers)
            _log.debug(
                "pipepar: runs of kind %s on the %s (medians: calling thread %.3f ms, "
                "workers %.3f ms)",
                kind,
                "calling thread" if trials.choice else "workers",
                statistics.median(trials.caller) * 1e3,
                statistics.median(trials.workers) * 1e3,
            )

    def choices(self) -> dict[Hashable, bool | None]:
        """Each kind timed so far, with its choice (True: the calling thread; None: not yet)."""
        return {kind: trials.choice for kind, trials in self._kinds.items()}

    def chosen(self, kind: Hashable) -> bool | None:
        """The choice made for ``kind`` (True: the calling thread); None while it is timed
        (or with a fixed mode, that mode's)."""
        if self.mode != "auto":
            return self.mode == "caller"
        trials = self._kinds.get(kind)
        return None if trials is None else trials.choice


def _faster_on_caller(caller: list[float], workers: list[float]) -> bool:
    """Whether the calling thread's median beats the workers' by :data:`MARGIN`."""
    return statistics.median(caller) * MARGIN < statistics.median(workers)


def choice_for(devices: Sequence[torch.device], mode: str) -> ThreadChoice:
    """The choice of a pipe whose workers are on ``devices``: ``mode``
    (``PIPEPAR_RUN_ON``), but ``"auto"`` only where every worker is on the CPU.

    Example:
        >>> choice_for([torch.device("cpu"), torch.device("cuda", 0)], "auto").mode
        'workers'
    """
    on_cpu = all(d.type == "cpu" for d in devices)
    return ThreadChoice(mode if mode != "auto" or on_cpu else "workers")


def under_callers_mode() -> bool:
    """Whether the calling thread runs under a torch-function or dispatch mode of its own
    (:class:`~pipepar.core.callers_modes.CallersModes`: not pipepar's, nor the default
    device's).

    Example:
        >>> from torch.utils.flop_counter import FlopCounterMode
        >>> with FlopCounterMode(display=False):
        ...     under_callers_mode()
        True
        >>> under_callers_mode()
        False
    """
    return bool(CallersModes.capture())
