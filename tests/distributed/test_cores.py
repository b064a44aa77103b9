"""pipepar.distributed.bind_cores: a rank's threads, those it had and those it starts, on its
share of the cores; its arguments from torchrun's variables; the documented errors. Each case
binds a child process (binding the test process would bind the rest of the suite)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

import pipepar.distributed as ppd
from pipepar.ranks.cores import share
from tests._ranks import context, settle

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="binding threads to cores is Linux only"
)


def _bound(args: tuple[int | None, int | None], env: dict[str, str], out: Any) -> None:
    import torch

    settle(env)
    torch.set_num_threads(64)
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait()

    before = threading.Thread(target=idle)
    before.start()
    started.wait()
    cores = ppd.bind_cores(*args)
    again = ppd.bind_cores(*args)  # from the same cores: the same share
    after: list[set[int]] = []
    later = threading.Thread(target=lambda: after.append(os.sched_getaffinity(0)))
    later.start()
    later.join()
    out.put(
        {
            "cores": cores,
            "again": again,
            "main": sorted(os.sched_getaffinity(0)),
            "before": sorted(os.sched_getaffinity(before.native_id)),
            "after": sorted(after[0]),
            "threads": torch.get_num_threads(),
        }
    )
    stop.set()
    before.join()


def _run(args: tuple[int | None, int | None], env: dict[str, str] | None = None) -> dict[str, Any]:
    ctx = context()
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_bound, args=(args, {**os.environ, **(env or {})}, out), daemon=True)
    p.start()
    p.join(60)
    if p.is_alive():  # never leave a child behind (pytest would wait for it at exit)
        p.kill()
        p.join()
    assert p.exitcode == 0
    return dict(out.get())


@pytest.mark.parametrize("k", [0, 1])
def test_every_thread_of_the_rank_runs_on_its_share_of_the_cores(k: int) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    want = share(allowed, k, 2)
    got = _run((k, 2))
    assert got["cores"] == got["again"] == want
    assert got["main"] == got["before"] == got["after"] == want
    assert got["threads"] == len(want)  # torch's math threads capped at the share


def test_the_counts_come_from_torchrun_variables() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    got = _run((None, None), {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert got["cores"] == share(allowed, 1, 2)


def test_shares_split_the_cores_in_equal_runs_and_never_come_out_empty() -> None:
    assert [share(range(8), k, 4) for k in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [share([0, 1, 2], k, 2) for k in range(2)] == [[0], [1, 2]]
    assert [share([5, 7], k, 4) for k in range(4)] == [[5], [5], [7], [7]]


def test_a_missing_or_wrong_count_is_a_value_error_naming_it(monkeypatch: Any) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match="local_rank is not given and LOCAL_RANK is not set"):
        ppd.bind_cores()
    with pytest.raises(ValueError, match=r"local_rank=2 must be in \[0, local_world_size=2\)"):
        ppd.bind_cores(2, 2)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        ppd.bind_cores(local_world_size=2)
