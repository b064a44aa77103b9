"""torchrun entry of the recovery tests: ``examples/hybrid_train.py`` as users run it, with a
fault armed: the rank of the last stage SIGKILLs itself in the middle of step ``KILL_STEP``
(at the loss of its second micro-batch), once.

    PIPEPAR_TEST_KILL_STEP=4 PIPEPAR_TEST_KILL_MARKER=DIR/killed \\
        torchrun ... tests/distributed/_recovery_main.py <hybrid_train.py's arguments>

"Once" is kept by the marker file, which the rank writes (with the time, for the test to
measure how long the others took to stop) just before it dies: a relaunch by hand or by
torchrun's ``--max-restarts`` finds it and trains on. Without the variables it is the example
unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hybrid_train


def arm(kill_step: int, marker: Path) -> None:
    """Make ``hybrid_train``'s loss kill this process at micro-batch 1 of step ``kill_step``."""
    batch, loss = hybrid_train.batch, hybrid_train.next_token_loss
    now = {"step": -1, "calls": 0}

    def batch_of_step(step: int, *args: Any) -> tuple[Tensor, Tensor]:
        now.update(step=step, calls=0)
        return batch(step, *args)

    def loss_or_death(logits: Tensor, target: Tensor) -> Tensor:
        now["calls"] += 1  # runs on the last stage only, once per micro-batch
        if now["step"] == kill_step and now["calls"] == 2 and not marker.exists():
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return loss(logits, target)

    hybrid_train.batch = batch_of_step
    hybrid_train.next_token_loss = loss_or_death


if __name__ == "__main__":
    if "PIPEPAR_TEST_KILL_STEP" in os.environ:
        arm(int(os.environ["PIPEPAR_TEST_KILL_STEP"]), Path(os.environ["PIPEPAR_TEST_KILL_MARKER"]))
    hybrid_train.main()
