"""torchrun entry of the many-nodes test: a transformers GPT-2 in a pp=2 x dp=2 grid runs every
training loop of ``_loop`` (zb-h1); each rank saves what it computed and where torchrun and
pipepar placed it.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 ... _multinode_main.py OUT_DIR CASES

Each rank writes ``OUT_DIR/rank<r>.pt``: per case (a comma list), what ``_loop.on_ranks``
returns (losses, norms, weights and the pipe's stage and replica), and under ``"place"``
torchrun's ``RANK``, ``GROUP_RANK`` (the node) and ``LOCAL_RANK``. The first case's
``ppd.wrap`` starts the process group from torchrun's environment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.distributed import _loop

DP, SCHEDULE = 2, "zb-h1"


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    _loop.settle()
    results: dict[str, object] = {case: _loop.on_ranks(case, DP, SCHEDULE) for case in cases}
    results["place"] = {key: int(os.environ[key]) for key in ("RANK", "GROUP_RANK", "LOCAL_RANK")}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
