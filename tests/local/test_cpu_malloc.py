"""pipepar.cpu_malloc: training CPU stages keep gradient-sized blocks in the heap, once per process.

Each case runs in a fresh interpreter: the thresholds are process-wide and the test process has
long since built pipes. Whether a large block is mmapped is read from glibc's own count
(``mallinfo2().hblks``), so the tests see the allocator's behaviour, not a flag of ours. One
interpreter may run several pipes in turn, each followed by its own large block (every block is
kept: freeing an mmapped block would raise glibc's adaptive threshold); a pipe that leaves glibc
alone leaves the next one's measurement as a fresh interpreter's. The tests' interpreters start
together when the first test asks for its own (most of each one's time is importing torch, on
one core), and each test reads what its own printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

glibc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
pytestmark = pytest.mark.skipif(
    glibc is None or tuple(map(int, glibc.split()[1].split(".")[:2])) < (2, 33),
    reason="needs glibc >= 2.33 (mallinfo2)",
)

PROBE = textwrap.dedent(
    """
    import ctypes, sys
    import torch
    from torch import nn
    import pipepar

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
                    .split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info

    blocks = []
    for case in sys.argv[1:]:
        devices, checkpoint, mode = case.split(":")
        devices, train = devices.split(","), mode == "train"
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        balance = [2, 1] if len(devices) == 2 else [3]
        pipe = pipepar.wrap(model, balance, devices=devices, chunks=2, checkpoint=checkpoint)
        with torch.set_grad_enabled(train):
            out = pipe(torch.randn(4, 8))
        if train:
            out.sum().backward()
        before = libc.mallinfo2().hblks
        blocks.append(torch.empty(6 << 20))  # 24 MiB: above any threshold glibc adapted to
        print(libc.mallinfo2().hblks - before)
    """
)


Case = tuple[str, str, str]  # devices ("cpu,cpu"), checkpoint, "train" or "eval"
Probe = tuple[tuple[Case, ...], tuple[tuple[str, str], ...]]  # cases run in turn, environment

TRAIN_TWO_STAGES: Case = ("cpu,cpu", "except_last", "train")
ONE_STAGE_PLAIN: Case = ("cpu", "never", "train")  # one stage, nothing to recompute
EVALUATION: Case = ("cpu,cpu", "except_last", "eval")  # no gradients to sum
ONE_STAGE_RECOMPUTING: Case = ("cpu", "except_last", "train")  # the engine sums its gradients

TRAINING: Probe = ((TRAIN_TWO_STAGES,), ())
LEFT_ALONE: Probe = ((ONE_STAGE_PLAIN, EVALUATION, ONE_STAGE_RECOMPUTING), ())
OPT_OUT: Probe = ((TRAIN_TWO_STAGES,), (("PIPEPAR_TUNE_MALLOC", "0"),))
USER_THRESHOLD: Probe = ((TRAIN_TWO_STAGES,), (("MALLOC_MMAP_THRESHOLD_", "131072"),))
PROBES = (TRAINING, LEFT_ALONE, OPT_OUT, USER_THRESHOLD)
Probes = dict[Probe, subprocess.Popen[str]]  # each probe's interpreter


def _start(probe: Probe) -> subprocess.Popen[str]:
    """The probe's fresh interpreter, running its cases in turn."""
    cases, env = probe
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, *(":".join(case) for case in cases)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )


@pytest.fixture(scope="module")
def probes() -> Iterator[Probes]:
    """Every probe's interpreter, started at once."""
    running = {probe: _start(probe) for probe in PROBES}
    yield running
    for proc in running.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _blocks(probes: Probes, probe: Probe) -> list[int]:
    """Per case of ``probe``, run in turn in one fresh interpreter: the number of mmapped
    blocks a 24 MiB tensor takes after a pipe on its devices ran."""
    proc = probes[probe]
    out, err = proc.communicate(timeout=300)  # a hang guard; the four share the cores
    assert proc.returncode == 0, err
    return [int(line) for line in out.split()]


def test_training_on_cpu_stages_keeps_large_blocks_in_the_heap(probes: Probes) -> None:
    assert _blocks(probes, TRAINING) == [0]


def test_plain_autograd_and_inference_leave_glibc_alone_a_recomputing_stage_does_not(
    probes: Probes,
) -> None:
    assert _blocks(probes, LEFT_ALONE) == [1, 1, 0]


def test_opt_out_keeps_glibc_defaults(probes: Probes) -> None:
    assert _blocks(probes, OPT_OUT) == [1]


def test_user_malloc_settings_are_respected(probes: Probes) -> None:
    # The user's own (small) threshold stays: the block is still mmapped after the pipe ran.
    assert _blocks(probes, USER_THRESHOLD) == [1]
