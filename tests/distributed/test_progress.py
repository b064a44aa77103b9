"""pipepar.ranks.progress without a process group: a rank's line, bounded waits, the
store board (on a HashStore) and, for NCCL's unbounded waits, the log of a rank standing still.

The stalls themselves, across processes, are in test_distributed_faults."""

from __future__ import annotations

import logging
import pickle
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipepar.ranks.arguments import check_timeout
from pipepar.ranks.failure import CommError, StallError, Where, wait
from pipepar.ranks.progress import Progress, ProgressBoard

HERE, PEER = Where(rank=1, stage=1, replica=0), Where(rank=0, stage=0, replica=0)


class _Work:
    """Stands for a c10d work: records how it was awaited, or fails with ``error``."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.waited_with: list[object] = []

    def wait(self, *timeout: timedelta) -> bool:
        self.waited_with.append(timeout)
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def test_a_line_says_what_the_rank_runs_waits_for_and_finished() -> None:
    p = Progress(3.0)
    assert p.line(HERE) == "rank 1 (stage 1, replica 0) has not started a step"
    p.begin("start of the mini-batch")
    p.begin("forward of micro-batch 0")
    p.waiting = "receiving activation 0 for stage 1 from rank 0 (stage 0)"
    assert p.line(HERE) == (
        "rank 1 (stage 1, replica 0) is in step 1 at the forward of micro-batch 0, blocked in "
        "receiving activation 0 for stage 1 from rank 0 (stage 0), last finished the start of "
        "the mini-batch"
    )
    p.waiting = None
    p.end_step()
    p.end_step()  # outside a step: nothing more finishes
    assert p.line(HERE) == "rank 1 (stage 1, replica 0) finished step 1 and is outside pipe.step"
    p.begin("backward of micro-batch 2")
    assert "is in step 2 at the backward of micro-batch 2, not blocked in a transfer" in p.line(
        HERE
    )


def test_a_wait_that_runs_out_of_time_is_a_stall_naming_what_it_waited_for() -> None:
    what = "receiving activation 3 for stage 2 from rank 1 (stage 1)"
    work = _Work("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    with pytest.raises(StallError) as stall:
        Progress(3.0).wait(work, what)  # type: ignore[arg-type]
    assert work.waited_with == [(timedelta(seconds=3),)]
    assert stall.value.what == what and stall.value.timeout == 3.0
    assert str(stall.value).startswith(f"{what}: no answer within timeout=3 s; every rank")
    assert "pass a larger timeout to ppd.wrap if it is only slow, or timeout=None" in str(
        stall.value
    )
    for message in ("Operation timed out!", "Work ran for 3000 milliseconds before timing out"):
        with pytest.raises(StallError):  # the c10d work's and NCCL's words for it
            wait(_Work(message), what, timedelta(seconds=3))  # type: ignore[arg-type]
    with pytest.raises(CommError, match="Connection closed by peer") as closed:
        wait(_Work("Connection closed by peer"), what, timedelta(seconds=3))  # type: ignore[arg-type]
    assert not isinstance(closed.value, StallError)


def test_waits_are_unbounded_without_a_timeout_or_under_nccl() -> None:
    for progress in (Progress(None), Progress(3.0, bounded=False)):
        work = _Work()
        progress.wait(work, "sharing the loss")  # type: ignore[arg-type]
        assert work.waited_with == [()]  # work.wait(): NCCL orders streams, no CPU deadline
        assert progress.waiting is None
    progress.wait(None, "a rank outside the group")  # nothing to wait for
    pending = [(_Work(), "sending a"), (_Work(), "sending b")]
    Progress(3.0).wait_all(pending)  # type: ignore[arg-type]
    assert pending == []


def test_a_stall_report_keeps_what_the_others_did() -> None:
    error = StallError("receiving x from rank 0 (stage 0)", 2.0, PEER_LINE)
    assert f"no answer within timeout=2 s [{PEER_LINE}]; every rank" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.what, again.timeout, again.others) == (error.what, 2.0, PEER_LINE)


PEER_LINE = "rank 0 (stage 0, replica 0) is in step 2 at the forward of micro-batch 1"


def test_the_board_publishes_a_line_that_peers_read() -> None:
    store = dist.HashStore()
    mine, theirs = Progress(0.5), Progress(0.5)
    boards = [
        ProgressBoard(mine, store, "p/", HERE, peers=[0]),
        ProgressBoard(theirs, store, "p/", PEER, peers=[1]),
    ]
    try:
        theirs.begin("forward of micro-batch 1")
        time.sleep(0.3)  # a few looks of the thread (every timeout / 10)
        assert boards[0].others() == (
            "rank 0 (stage 0, replica 0) is in step 1 at the forward of micro-batch 1, not "
            "blocked in a transfer"
        )
        lonely = ProgressBoard(Progress(0.5), store, "q/", HERE, peers=[5])
        assert lonely.others() == "rank 5: no line yet"
        lonely.stop()
    finally:
        for board in boards:
            board.stop()


def test_no_timeout_no_thread_and_no_report() -> None:
    board = ProgressBoard(Progress(None), dist.HashStore(), "p/", HERE, peers=[0])
    assert board._thread is None and board.others() == ""
    assert check_timeout(None) is None and check_timeout(2) == 2.0
    with pytest.raises(ValueError, match=r"or None \(no limit\), but got 0; e.g. timeout=300"):
        check_timeout(0)


@pytest.mark.parametrize("bounded", [False, True])
def test_under_nccl_a_rank_standing_still_is_logged_before_the_watchdog(
    caplog: pytest.LogCaptureFixture, bounded: bool
) -> None:
    store, progress, peer = dist.HashStore(), Progress(0.5, bounded=bounded), Progress(0.5)
    boards = [
        ProgressBoard(progress, store, "p/", HERE, peers=[0]),
        ProgressBoard(peer, store, "p/", PEER, peers=[1]),
    ]
    progress.begin("backward of micro-batch 3")
    with caplog.at_level(logging.WARNING, logger="pipepar.ranks.progress"):
        time.sleep(0.8)  # over 0.8 x the timeout
    for board in boards:
        board.stop()
    logged = [r.getMessage() for r in caplog.records]
    if bounded:  # gloo: the wait itself raises at the timeout, nothing to log
        assert logged == []
        return
    assert len(logged) == 1, logged
    assert logged[0].startswith(
        "pipepar: rank 1 (stage 1, replica 0) is in step 1 at the backward of micro-batch 3"
    )
    assert "of its timeout=0.5 s" in logged[0]
    assert logged[0].endswith("; rank 0 (stage 0, replica 0) has not started a step")
