"""One training loop, both runtimes: the same cases (accumulation over calls, clipping by the
whole model's norm, evaluation between steps, frozen tied weights, LoRA adapters, a sequence
length that changes per step, a batch smaller than chunks) through a one-process pipe and two
torchrun ranks (pp=2), each against the plain model. Four ranks (pp=2 x dp=2, zb-h1) run them
as two nodes in test_multinode."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import _loop

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5


CASES = _loop.installed()


def _same(got: dict[str, Any], want: dict[str, Any], where: str, rtol: float = RTOL) -> None:
    for key in ("loss", "norm", "eval"):
        assert len(got[key]) == len(want[key]), (where, key)
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= rtol * max(abs(b), 1e-6), f"{where}: {key} {got[key]} {want[key]}"
    # computed in the caller's autocast dtype (where this process computes the output)
    assert got["dtype"] in (None, want["dtype"]), (where, got["dtype"], want["dtype"])
    frozen = got["frozen_grads"]
    assert frozen == [], f"{where}: frozen weights got gradients: {frozen}"
    scale = max(w.abs().max().item() for w in want["weights"].values())
    for name, w in got["weights"].items():
        err = (w - want["weights"][name]).abs().max().item() / scale
        assert err < rtol, f"{where}: weight {name} off by {err:.2e}"


def check_ranks(ranks: list[dict[str, Any]], plain: dict[str, dict[str, Any]], label: str) -> None:
    """Every case on every rank equals the plain model's run, and the ranks together hold
    every weight."""
    for case in CASES:
        seen: set[str] = set()
        for r, results in enumerate(ranks):
            got = results[case]
            assert not isinstance(got, str), f"rank {r}, {case}:\n{got}"
            where = f"rank {r} of {len(ranks)} ({label}), {case}"
            _same(got, plain[case], where, _loop.TOLERANCE.get(case, RTOL))
            seen |= set(got["weights"])
        trained = {n for n, p in plain[case]["weights"].items()}
        assert seen == trained, f"{case}: no rank holds {trained - seen}"
        assert any(r[case]["dtype"] is not None for r in ranks), case  # the last stage's ranks


@pytest.mark.parametrize("case", CASES)
def test_one_process_loop_equals_plain(case: str, loop_plain: dict[str, dict[str, Any]]) -> None:
    got = _loop.one_process(case)
    assert got["dtype"] == loop_plain[case]["dtype"]
    _same(got, loop_plain[case], "one process", _loop.TOLERANCE.get(case, RTOL))


def _torchrun(tmp: Path, nproc: int, dp: int, schedule: str) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
        str(ROOT / "tests/distributed/_loop_main.py"), str(tmp), "--dp", str(dp),
        "--schedule", schedule, "--cases", ",".join(CASES),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.mark.slow
def test_ranks_loop_equals_plain(tmp_path: Path, loop_plain: dict[str, dict[str, Any]]) -> None:
    check_ranks(_torchrun(tmp_path, 2, 1, "1f1b"), loop_plain, "pp=2, 1f1b")
