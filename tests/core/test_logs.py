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


def _stderr(debug: str) -> str:
    env = {**os.environ, "PIPEPAR_DEBUG": debug}
    run = subprocess.run(
        [sys.executable, "-c", CODE], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return run.stderr


def test_debug_prints_each_hand_off_between_stages() -> None:
    shown = _stderr("1")
    assert "pipepar.local.worker put ('F', 1, 0)" in shown
    assert "pipepar.local.worker take ('F', 2, 1)" in shown
    assert "pipepar.local" not in _stderr("0")
