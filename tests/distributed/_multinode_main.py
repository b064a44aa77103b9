"""torchrun entry of the many-nodes test: a transformers GPT-2 in a pp=2 x dp=2 grid trains a
few steps (``_loop``'s ``clip_accumulate`` case); each rank saves what it computed and where
torchrun and pipepar placed it.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 ... _multinode_main.py OUT_DIR

Each rank writes ``OUT_DIR/rank<r>.pt``: the run's losses, norms and weights (as ``_loop.run``
returns them) and its place: torchrun's ``RANK``, ``GROUP_RANK`` (the node), ``LOCAL_RANK``,
and the pipe's stage and replica.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import pipepar.distributed as ppd
from tests.distributed import _loop

CASE = "clip_accumulate"
PP, DP = 2, 2


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pipe = ppd.wrap(  # starts the process group from torchrun's environment
        _loop.build(CASE),
        split=[_loop.split_path(CASE)],
        chunks=_loop.CHUNKS,
        schedule="1f1b",
        dp=DP,
        timeout=60,
    )
    where = pipe.mesh.where
    result = _loop.run(CASE, _loop.Piped(pipe), replica=where.replica, dp=DP)
    place = {key: int(os.environ[key]) for key in ("RANK", "GROUP_RANK", "LOCAL_RANK")}
    result["place"] = {**place, "stage": where.stage, "replica": where.replica}
    pipe.close()
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
