"""Faults, exactly recovered: ``examples/hybrid_train.py`` (pp=2, saving every 3 steps) loses its
last stage's rank to SIGKILL in the middle of step 4; the other rank stops with the cause
well within the pipe's timeout instead of hanging; the job goes on from the checkpoint of step
2, relaunched by hand or by torchrun's ``--max-restarts``, and ends with weights and optimizer
state equal, bit for bit, to those of a run that was never interrupted.

The fault is armed by ``_recovery_main.py`` around the unchanged example.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from pipepar.persist.sharded import to_single_file
from tests._ranks import context, settle
from tests.distributed import _launch, _recovery_main

SCRIPT = Path(_recovery_main.__file__)
TIMEOUT_S = 20.0  # the pipe's: how long a rank may wait for a peer
KILL_STEP, SAVE_EVERY, STEPS = 4, 3, 6  # killed in step 4: the last save is step 2's
TRAIN = [
    "--pp", "2", "--dp", "1", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
    "--chunks", "4", "--batch", "8", "--depth", "2", "--log-every", "1",
    "--timeout", str(TIMEOUT_S),
]  # fmt: skip
LIMIT_S = 180  # per launch, far above the ~10 s each takes on 2 busy cores
OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RESUMED = f"resuming at step {KILL_STEP // SAVE_EVERY * SAVE_EVERY}"


def _start(
    tmp: Path,
    name: str,
    args: list[str],
    *,
    nodes: int,
    kill: Path | None = None,
    env: dict[str, str] | None = None,
    **options: Any,
) -> list[_launch.Launch]:
    """Launch the example on 2 ranks: one node of 2, or ``nodes=2`` nodes of 1 each; with the
    fault armed where ``kill`` (the marker file) is given."""
    port = _launch.free_port()
    env = dict(env or {})
    if kill is not None:
        env |= {"PIPEPAR_TEST_KILL_STEP": str(KILL_STEP), "PIPEPAR_TEST_KILL_MARKER": str(kill)}
    nproc = 2 // nodes
    return [
        _launch.launch(
            _launch.torchrun_command(
                SCRIPT, TRAIN + args, port=port, nproc=nproc, nnodes=nodes, node_rank=node,
                **options,
            ),
            tmp / f"{name}-node{node}.log",
            env,
        )
        for node in range(nodes)
    ]  # fmt: skip


def _succeeds(runs: list[_launch.Launch]) -> str:
    _launch.wait(runs, LIMIT_S)
    assert [r.proc.returncode for r in runs] == [0] * len(runs), _launch.report(runs)
    return "\n".join(r.output for r in runs)


def _final(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint directory as one file's dict (what ``pipepar convert`` writes)."""
    one = to_single_file(checkpoint, checkpoint.with_name(checkpoint.name + ".pt"))
    return dict(torch.load(one, weights_only=True))


def _differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where two nested checkpoints differ: tensors bit for bit, other values by ``==``."""
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and torch.equal(got, want)
        return [] if same and got.dtype == want.dtype else [where]
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping) or got.keys() != want.keys():
            return [f"{where} (keys)"]
        return [d for k in want for d in _differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where} (length)"]
        return [
            d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{where}/{i}")
        ]
    return [] if got == want else [where]


def _uninterrupted_rank(rank: int, port: int, out: Path, env: dict[str, str]) -> None:
    """Rank ``rank`` of the example's run without a fault, in the environment torchrun gives
    a rank of one node of 2 (the example starts its process group from it)."""
    place = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": 1}
    settle(env | {k: str(v) for k, v in (place | where).items()})
    torch.set_num_threads(1)
    sys.argv = [str(SCRIPT), *TRAIN, "--out", str(out)]
    _recovery_main.hybrid_train.main()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final checkpoint of the run without a fault: the example's ``main`` on 2 ranks
    forked from the tests' preloaded server (the same computation as under torchrun, without
    three interpreters importing torch; the faulty runs are launched by torchrun)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    ctx, port, env = context(), _launch.free_port(), dict(os.environ)
    ranks = [
        ctx.Process(target=_uninterrupted_rank, args=(r, port, tmp / "ckpt", env)) for r in (0, 1)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(LIMIT_S)
        if rank.exitcode is None:
            rank.kill()
            rank.join()
    codes = [rank.exitcode for rank in ranks]
    assert codes == [0, 0], f"the uninterrupted run failed: exit codes {codes} (output: stderr)"
    final = _final(tmp / "ckpt")
    assert final["extra"] == {"step": STEPS - 1}, final["extra"]
    return final


def _same_as(checkpoint: Path, want: dict[str, Any]) -> None:
    got = _final(checkpoint)
    assert got["model"].keys() == want["model"].keys()
    differ = _differences(got, want)
    assert not differ, f"the resumed run differs from the uninterrupted one at {differ}"


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_and_a_relaunch_by_hand_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """Two nodes of one rank each (static rendezvous): node 1's rank dies, node 0's rank is
    not killed by its torchrun but stops by itself, saying why."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "killed"
    args = ["--out", str(ckpt), "--resume", "auto"]
    runs = _start(tmp_path, "killed", args, nodes=2, kill=marker, rendezvous="static")
    _launch.wait(runs, LIMIT_S)
    survivor, dead = runs
    assert marker.exists(), _launch.report(runs)
    assert dead.proc.returncode != 0 and "Signal 9 (SIGKILL)" in dead.output, _launch.report(runs)
    assert survivor.proc.returncode != 0, _launch.report(runs)
    # where it stood when the connection broke varies (receiving a gradient, sending an
    # activation ...); that a peer died does not
    cause = r"PipelineError: pipeline failed: rank 0 \(stage 0, replica 0\) failed in the .*"
    cause += r"Connection (closed|reset) by peer.*a peer process died"
    assert re.search(cause, survivor.output), survivor.output[-6000:]
    assert survivor.ended_at is not None
    stopped_after = survivor.ended_at - float(marker.read_text())
    print(f"rank 0 and its torchrun stopped {stopped_after:.2f} s after rank 1 died")
    assert stopped_after < TIMEOUT_S, f"rank 0 ran on {stopped_after:.1f} s after rank 1 died"
    assert ckpt.is_dir() and not (tmp_path / ".ckpt.tmp").exists()  # step 2's, complete

    # the same job again, by hand, from the checkpoint
    by_hand = ["--out", str(ckpt), "--resume", str(ckpt)]
    again = _start(tmp_path, "again", by_hand, nodes=2, rendezvous="static")
    output = _succeeds(again)
    assert RESUMED in output, output[-6000:]
    _same_as(ckpt, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_max_restarts_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[str, Any], nodes: int
) -> None:
    """``--max-restarts 1``, c10d rendezvous: torchrun stops the survivor (one node) or it
    stops by itself and its node rejoins (two nodes); both ranks start again and
    ``--resume auto`` finds the checkpoint. The restarted ranks need a store of their own
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): in the store that torchrun shares by default
    they can read the first attempt's addresses and fail to connect."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "killed"
    args = ["--out", str(ckpt), "--resume", "auto"]
    runs = _start(
        tmp_path, "restarted", args, nodes=nodes, kill=marker, max_restarts=1, env=OWN_STORE
    )
    output = _succeeds(runs)
    assert marker.exists(), output[-6000:]
    assert f"{RESUMED} from {ckpt}" in output, output[-6000:]
    if nodes == 1:  # a node restarted for another node's failure keeps its count (0)
        assert "(torchrun restart 1)" in output, output[-6000:]
    _same_as(ckpt, uninterrupted)
