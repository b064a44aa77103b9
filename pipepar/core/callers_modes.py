"""The caller's torch-function and dispatch modes, entered again wherever a stage computes.

A mode (``FlopCounterMode``, a debugging mode, one that simulates quantization) sees every
operation run while it is entered, on the thread that entered it: its stack is the thread's own.
A step's operations run on other threads too: a model cut while it runs computes its forward on
a thread of its own per micro-batch (:mod:`pipepar.program.driver`), a pipe's workers run
stages. A step takes the caller's modes when it is made and enters them around each forward on
a thread that lacks them, as it does autocast and the saved-tensor hooks
(:mod:`pipepar.core.saved_hooks`), outermost, so pipepar's own modes run inside them as they
would inside a mode around the plain model. A mode is used by one thread at a time: under one
the pipe runs its actions on the calling thread (:mod:`pipepar.local.thread_choice`), and a
forward's thread computes only while the action that resumed it waits.

Not the caller's: pipepar's own modes, and the default device's (``torch.set_default_device``,
``with torch.device(...)``), which each stage's placement replaces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import overrides
from torch.utils import _python_dispatch as dispatch

__all__ = ["CallersModes"]


@dataclass(frozen=True)
class CallersModes:
    """The caller's function modes and dispatch modes, innermost last.

    Example:
        >>> from torch.utils.flop_counter import FlopCounterMode
        >>> with FlopCounterMode(display=False):
        ...     modes = CallersModes.capture()
        >>> bool(modes), bool(CallersModes.capture())
        (True, False)
    """

    functions: tuple[Any, ...]
    dispatches: tuple[Any, ...]

    @classmethod
    def capture(cls) -> CallersModes:
        """The calling thread's modes now, but pipepar's own and the default device's."""
        if not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()):
            return _NONE
        functions = tuple(filter(_callers, overrides._get_current_function_mode_stack()))
        dispatches = tuple(filter(_callers, dispatch._get_current_dispatch_mode_stack()))
        return cls(functions, dispatches)

    def __bool__(self) -> bool:
        return bool(self.functions or self.dispatches)

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        """The modes this thread lacks, entered (as they are: a mode's own ``__enter__`` runs
        once, on the caller's thread); nothing where it has them all."""
        if not self:
            return contextlib.nullcontext()
        return self._entered()

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        had_functions = {id(m) for m in overrides._get_current_function_mode_stack()}
        had_dispatches = {id(m) for m in dispatch._get_current_dispatch_mode_stack()}
        functions = [m for m in self.functions if id(m) not in had_functions]
        dispatches = [m for m in self.dispatches if id(m) not in had_dispatches]
        for mode in functions:
            overrides._push_mode(mode)
        for mode in dispatches:
            dispatch._push_mode(mode)
        try:
            yield
        finally:
            for mode in reversed(dispatches):
                dispatch._pop_mode(getattr(mode, "_mode_key", None))
            for _ in functions:
                overrides._pop_mode()


_NONE = CallersModes((), ())


def _callers(mode: object) -> bool:
    kind = type(mode)
    return not (kind.__module__.startswith("pipepar.") or kind.__name__ == "DeviceContext")
