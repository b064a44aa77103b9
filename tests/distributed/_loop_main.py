"""torchrun entry for the training-loop tests: every case of ``_loop`` on this rank.

    torchrun --nproc-per-node 4 tests/distributed/_loop_main.py OUT_DIR --dp 2 --schedule 1f1b

Each rank saves ``OUT_DIR/rank<r>.pt``: per case, what ``_loop.run`` returns (or the error).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.distributed import _loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--cases", default=",".join(_loop.CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    _loop.settle()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for case in args.cases.split(","):
        try:
            results[case] = _loop.on_ranks(case, args.dp, args.schedule)
        except Exception:
            results[case] = traceback.format_exc()
            break  # the other ranks failed too: the groups are gone
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
