"""torchrun entry for the stall test: of two ranks, rank 1 skips a step (it sleeps outside
pipe.step, as behind a data loader that ran dry, then steps late).

    torchrun --nproc-per-node 2 tests/distributed/_stall_main.py OUT_DIR TIMEOUT NAP

Rank 1 is away ``NAP`` seconds, past the pipe's ``TIMEOUT``. ``ppd.wrap`` starts the process
group from torchrun's environment. Each rank writes
``OUT_DIR/rank<r>.json``: what its second step raised, and how long that step took.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import pipepar.distributed as ppd


def main() -> None:
    out, timeout, nap = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())])
    pipe = ppd.wrap(model, [4, 4], chunks=2, schedule="1f1b", timeout=timeout)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe.step(x, y, nn.functional.mse_loss)
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(nap)
    result = {"raised": "nothing", "message": ""}
    start = time.monotonic()
    try:
        pipe.step(x, y, nn.functional.mse_loss)
    except ppd.PipelineError as e:
        result = {"raised": type(e).__name__, "message": str(e)}
    result["elapsed"] = time.monotonic() - start
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
