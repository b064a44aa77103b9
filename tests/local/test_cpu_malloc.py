"""pipepar.cpu_malloc: training CPU stages keep gradient-sized blocks in the heap, once per process.

Each case runs in a fresh interpreter: the thresholds are process-wide and the test process has
long since built pipes. Whether a large block is mmapped is read from glibc's own count
(``mallinfo2().hblks``), so the tests see the allocator's behaviour, not a flag of ours.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    devices, checkpoint, train = sys.argv[1].split(","), sys.argv[2], sys.argv[3] == "train"
    balance = [2, 1] if len(devices) == 2 else [3]
    pipe = pipepar.wrap(model, balance, devices=devices, chunks=2, checkpoint=checkpoint)
    with torch.set_grad_enabled(train):
        out = pipe(torch.randn(4, 8))
    if train:
        out.sum().backward()
    before = libc.mallinfo2().hblks
    block = torch.empty(6 << 20)  # 24 MiB: above any threshold glibc adapted to while importing
    print(libc.mallinfo2().hblks - before)
    """
)


def _probe(devices: str, checkpoint: str = "except_last", mode: str = "train", **env: str) -> int:
    """Number of mmapped blocks a 24 MiB tensor takes after a pipe on ``devices`` ran."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, devices, checkpoint, mode],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=True,
    ).stdout
    return int(out)


def test_training_on_cpu_stages_keeps_large_blocks_in_the_heap() -> None:
    assert _probe("cpu,cpu") == 0
    assert _probe("cpu") == 0  # one stage that recomputes: the engine sums its gradients


def test_plain_autograd_and_inference_leave_glibc_alone() -> None:
    assert _probe("cpu", checkpoint="never") == 1  # one stage, nothing to recompute
    assert _probe("cpu,cpu", mode="eval") == 1  # no gradients to sum


def test_opt_out_keeps_glibc_defaults() -> None:
    assert _probe("cpu,cpu", PIPEPAR_TUNE_MALLOC="0") == 1


def test_user_malloc_settings_are_respected() -> None:
    # The user's own (small) threshold stays: the block is still mmapped after the pipe ran.
    assert _probe("cpu,cpu", MALLOC_MMAP_THRESHOLD_="131072") == 1
