"""Stage workers set their own math-thread count and leave everyone else's as it was."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import pipepar
from pipepar.local import worker


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


_CPU, _CUDA = torch.device("cpu"), torch.device("cuda", 0)
_LINUX = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="binding threads to cores is Linux's"
)


@_LINUX
@pytest.mark.parametrize(
    ("devices", "threads", "allowed", "want"),
    [
        ([_CPU, _CPU], [1, 1], {0, 1}, [0, 1]),  # two stages, threads=1, two cores: bound
        ([_CUDA, _CPU, _CPU], [1, 1, 1], {7, 4}, [None, 4, 7]),  # CUDA workers stay unbound
        ([_CPU, _CPU], [1, 1], {0, 1, 2}, [None, None]),  # a spare core: left to the system
        ([_CPU, _CPU], [2, 1], {0, 1, 2}, [None, None]),  # several math threads
        ([_CPU], [1], {0}, [None]),  # one worker
    ],
)
def test_workers_bound_to_a_core_each_only_when_they_fill_the_cores(
    monkeypatch: pytest.MonkeyPatch,
    devices: list[torch.device],
    threads: list[int],
    allowed: set[int],
    want: list[int | None],
) -> None:
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: set(allowed))
    monkeypatch.delenv("PIPEPAR_PIN_WORKERS", raising=False)
    assert worker.worker_cores(devices, threads) == want
    monkeypatch.setenv("PIPEPAR_PIN_WORKERS", "0")
    assert worker.worker_cores(devices, threads) == [None] * len(devices)


class _Where(nn.Module):
    """Records the cores the thread that runs its forward may use."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.cores: list[set[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cores.append(os.sched_getaffinity(0))
        return self.linear(x)


@_LINUX
def test_each_worker_runs_on_the_core_it_is_given() -> None:
    """The stage workers run where :func:`worker_cores` says (bound to one core each where the
    two workers fill the process's cores, as on a 2-core machine; unbound elsewhere), and the
    caller's thread keeps its cores."""
    allowed = os.sched_getaffinity(0)
    layers = [_Where(), _Where()]
    pipe = pipepar.wrap(nn.Sequential(*layers), [1, 1], devices=["cpu", "cpu"], chunks=2, threads=1)
    try:
        pipe(torch.randn(4, 8)).sum().backward()
    finally:
        pipe.close()
    cores = worker.worker_cores([_CPU, _CPU], [1, 1])
    for layer, core in zip(layers, cores):
        assert layer.cores and all(
            c == ({core} if core is not None else allowed) for c in layer.cores
        )
    assert os.sched_getaffinity(0) == allowed
