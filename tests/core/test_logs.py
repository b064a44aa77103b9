"""``PIPEPAR_DEBUG=1`` makes the ``pipepar`` logger print every hand-off, in one process too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import torch, pipepar
from torch import nn
pipe = pipepar.wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1],
                    devices=["cpu", "cpu"], chunks=2)
pipe(torch.randn(2, 2))
"""


def _stderrs(*debug: str) -> list[str]:
    """The stderr of ``CODE`` per value of ``PIPEPAR_DEBUG``; the interpreters start together
    (each spends most of its time importing torch, on one core)."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CODE],
            env={**os.environ, "PIPEPAR_DEBUG": value},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in debug
    ]
    shown = []
    for run in runs:
        _, err = run.communicate()
        assert run.returncode == 0, err
        shown.append(err)
    return shown


def test_debug_prints_each_hand_off_between_stages() -> None:
    shown, quiet = _stderrs("1", "0")
    assert "pipepar.local.worker put ('F', 1, 0)" in shown
    assert "pipepar.local.worker take ('F', 2, 1)" in shown
    assert "pipepar.local" not in quiet
