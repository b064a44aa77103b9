"""pipepar.local.core_follow: a driver thread computing with one math thread is pinned to the
core of the thread that hands it its turn; one with several keeps every core it may use."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from pipepar.local import core_follow
from pipepar.local.core_follow import CoreFollower

pytestmark = pytest.mark.skipif(
    core_follow._GETCPU is None, reason="pinning threads to cores needs Linux's sched_getcpu"
)


class _Thread:
    """A thread that calls ``follower.started()`` with ``threads`` math threads, then idles."""

    def __init__(self, follower: CoreFollower, threads: int) -> None:
        self._ready, self._stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(follower, threads))
        self.thread.start()
        self._ready.wait()

    def _run(self, follower: CoreFollower, threads: int) -> None:
        torch.set_num_threads(threads)
        follower.started()
        self._ready.set()
        self._stop.wait()

    def cores(self) -> set[int]:
        assert self.thread.native_id is not None
        return os.sched_getaffinity(self.thread.native_id)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


@pytest.fixture
def main_cores() -> Iterator[list[int]]:
    """The cores this thread may use; its affinity is restored after the test."""
    before = os.sched_getaffinity(0)
    yield sorted(before)
    os.sched_setaffinity(0, before)


def test_the_followed_thread_moves_to_each_core_its_caller_runs_on(main_cores: list[int]) -> None:
    threads = torch.get_num_threads()
    follower = CoreFollower()
    other = _Thread(follower, 1)
    try:
        for cpu in main_cores:
            os.sched_setaffinity(0, {cpu})  # the caller now runs on ``cpu``
            follower.follow()
            assert other.cores() == {cpu}
    finally:
        other.stop()
        torch.set_num_threads(threads)


def test_a_thread_with_several_math_threads_keeps_every_core(main_cores: list[int]) -> None:
    threads = torch.get_num_threads()
    follower = CoreFollower()
    other = _Thread(follower, 2)
    try:
        os.sched_setaffinity(0, {main_cores[0]})
        follower.follow()
        assert other.cores() == set(main_cores)
    finally:
        other.stop()
        torch.set_num_threads(threads)
