"""Shared test fixtures: every test starts from the same RNG state."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator

import pytest
import torch


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
