"""Stage workers set their own math-thread count and leave everyone else's as it was."""

from __future__ import annotations

import threading

import torch
from torch import nn

import pipepar


def _in_new_thread() -> int:
    """``torch.get_num_threads()`` as a thread started now sees it."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def _openmp_threads() -> int:
    """What OpenMP itself will use in the calling thread (``omp_get_max_threads()``)."""
    for line in torch.__config__.parallel_info().splitlines():
        if "omp_get_max_threads()" in line:
            return int(line.split(":")[-1])
    return torch.get_num_threads()  # a build without OpenMP: torch's own count is the one used


class Probe(nn.Module):
    """Records, in forward and backward, the thread count of the thread that runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.seen: list[tuple[str, int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._record()
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda g: self._record())
        return y

    def _record(self) -> None:
        thread = threading.current_thread().name
        self.seen.append((thread, torch.get_num_threads(), _openmp_threads()))


def _run_pipe(threads: int) -> list[Probe]:
    probes = [Probe(), Probe()]
    pipe = pipepar.wrap(
        nn.Sequential(*probes), [1, 1], devices=["cpu", "cpu"], chunks=2, threads=threads
    )
    pipe(torch.randn(8, 64)).sum().backward()
    pipe.close()
    return probes


def _workers_count(before: int) -> int:
    """A count that differs from the caller's, so a leak would show."""
    return 1 if before > 1 else 2


def test_caller_and_later_threads_keep_their_count() -> None:
    before_main, before_new = torch.get_num_threads(), _in_new_thread()
    _run_pipe(_workers_count(before_main))
    assert torch.get_num_threads() == before_main
    assert _in_new_thread() == before_new


def test_caller_setting_is_the_default_for_later_threads() -> None:
    # The user's own set_num_threads stays the default threads start with, after a pipe ran.
    original = torch.get_num_threads()
    mine = 2 if original != 2 else 3
    torch.set_num_threads(mine)
    try:
        _run_pipe(1)
        assert torch.get_num_threads() == mine
        assert _in_new_thread() == mine
    finally:
        torch.set_num_threads(original)


def test_workers_use_their_count() -> None:
    threads = _workers_count(torch.get_num_threads())
    probes = _run_pipe(threads)
    seen = [s for probe in probes for s in probe.seen]
    in_workers = [s for s in seen if s[0].startswith("pipepar-stage")]
    assert len(in_workers) >= 4  # forward and backward of 2 micro-batches per stage, at least
    assert all(torch_n == threads and omp_n == threads for _, torch_n, omp_n in in_workers)
