"""Shared test fixtures: every test starts from the same RNG state."""

from __future__ import annotations

import os

# Set before torch loads its OpenMP runtime (which reads it once): the math threads a test
# leaves idle sleep instead of spinning. On 2 cores a pipe's stage threads and the tests'
# own math threads outnumber the cores, and spinning threads took their time from the
# threads with work (a third of the CPU seconds of the pipe tests; wall time too).
# Processes the tests start (ranks, scripts) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gc
import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection imported (torch, transformers, every test module) to the cycle
    collector's permanent generation: its full passes then walk only what the tests make."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the main thread during the test, as in a terminal,
    even when the test runner was started with SIGINT ignored (``nohup``, ``cmd &`` in a
    script), where ``_thread.interrupt_main`` would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def offloaders(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The activation Offloaders the pipes make (to read what they moved)."""
    from pipepar.core import offload_plan
    from pipepar.core.offload_plan import Offloader

    made: list[Offloader] = []
    init = Offloader.__init__

    def record(self: Offloader, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(offload_plan.Offloader, "__init__", record)
    return made
