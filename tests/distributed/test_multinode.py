"""Many machines: two torchrun launches on localhost meet as two nodes (2 ranks each) and run
every training loop of ``_loop`` on a pp=2 x dp=2 zb-h1 pipe of a transformers GPT-2; every rank
ends with the losses and weights one plain process computes on the global batch.

torchrun numbers ranks node-major (node n holds ranks ``n * nproc .. n * nproc + nproc - 1``)
and pipepar puts group rank ``g`` at stage ``g % pp`` of replica ``g // pp``; with
``pp == nproc-per-node`` each pipeline lies within a node and only the replicas' gradient
all-reduce crosses nodes. Both ways to meet are tested: c10d (dynamic) rendezvous, where the
nodes take their node rank in the order they join, and static (``--master-addr`` and
``--node-rank``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import _launch, _multinode_main
from tests.distributed.test_training_loop import CASES, check_ranks

NODES, NPROC = 2, 2
LIMIT_S = 300  # the launches together, far above the ~40 s they take on 2 busy cores


def _two_nodes(tmp: Path, rendezvous: str) -> list[dict[str, Any]]:
    """Launch both nodes, wait for both; every rank's results, by global rank."""
    port = _launch.free_port()
    script = Path(_multinode_main.__file__)
    runs = [
        _launch.launch(
            _launch.torchrun_command(
                script, [str(tmp), ",".join(CASES)], port=port, nproc=NPROC, nnodes=NODES,
                node_rank=node, rendezvous=rendezvous,
            ),
            tmp / f"node{node}.log",
        )
        for node in range(NODES)
    ]  # fmt: skip
    _launch.wait(runs, LIMIT_S)
    assert [r.proc.returncode for r in runs] == [0] * NODES, _launch.report(runs)
    world = NODES * NPROC
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
def test_two_nodes_train_as_one_plain_process(
    tmp_path: Path, loop_plain: dict[str, dict[str, Any]]
) -> None:
    """Two nodes joined by c10d rendezvous, the one the README and the Slurm script use (the
    recovery tests launch with static rendezvous too)."""
    rendezvous = "c10d"
    ranks = _two_nodes(tmp_path, rendezvous)
    for rank, got in enumerate(ranks):
        place = got.pop("place")
        # node-major ranks; a pipeline per node (pp == nproc-per-node), replicas across nodes
        assert place["RANK"] == rank == place["GROUP_RANK"] * NPROC + place["LOCAL_RANK"], place
        for case in CASES:
            where = got[case]["place"]
            assert (where["stage"], where["replica"]) == (rank % NPROC, rank // NPROC), where
    check_ranks(ranks, loop_plain, f"two nodes, {rendezvous} rendezvous, zb-h1")
