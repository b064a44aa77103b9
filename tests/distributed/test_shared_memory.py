"""Same-host messages through shared memory (ranks.shared_memory), between real processes.

Each test joins a few gloo ranks on localhost and moves messages through
:func:`~pipepar.ranks.shared_memory.connect`'s rings as the pipe's transports do: per channel in
the order sent, whatever the order receives are posted in, through a ring smaller than the
message, and with the errors the pipe's waits turn into reports (a timeout, a peer that left,
a shape the ranks disagree on). The pipes' own tests run over the same rings (every pipeline of
neighbouring ranks on one host does).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipepar.ranks import shared_memory
from pipepar.ranks.shared_memory import connect
from tests._ranks import spawn

pytestmark = pytest.mark.skipif(
    not shared_memory.supported(), reason="shared-memory messages need x86-64 Linux"
)

_SMALL = 4096  # a ring smaller than the messages: they stream through it


def _values(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 700, generator=g),  # 8400 bytes: twice the ring
        torch.randint(0, 9, (5,), generator=g),
        torch.rand(40, generator=g) > 0.5,
        torch.empty(0),
        torch.randn(2, 3, generator=g, dtype=torch.float64),
        torch.arange(24.0).reshape(4, 6).t(),  # not contiguous: sent as its values
    ]


def _exchange(rank: int) -> list[Any]:
    """Rank 0 sends six values on two channels of each group; rank 1 posts the receives
    of the later channels first (in order within a channel, as with gloo), so the earlier
    messages wait in its stash, then sends them back."""
    sm = connect(dist.group.WORLD, rank, [0, 1], capacity=_SMALL)
    assert sm is not None
    peer = 1 - rank
    values = _values(0)
    channels = [("fwd", 8), ("bwd", 8), ("fwd", 9), ("fwd", 8), ("bwd", 9), ("bwd", 8)]
    if rank == 0:
        sends = [sm.isend(v, peer, g, t) for v, (g, t) in zip(values, channels)]
        for w in sends:
            w.wait(timedelta(seconds=30))
        back = [torch.empty(v.shape, dtype=v.dtype) for v in values]
        for b, (g, t) in zip(back, channels):
            sm.irecv(b, peer, g, t).wait(timedelta(seconds=30))
        return [torch.equal(a, b) for a, b in zip(values, back)]
    got = [torch.empty(v.shape, dtype=v.dtype) for v in values]
    works = {k: sm.irecv(got[k], peer, *channels[k]) for k in (4, 2, 1, 5, 0, 3)}
    for k in range(len(values)):
        works[k].wait(timedelta(seconds=30))
    for v, (g, t) in zip(got, channels):
        sm.isend(v, peer, g, t).wait()
    return [torch.equal(a, b) for a, b in zip(values, got)]


def test_messages_keep_their_order_per_channel_through_a_small_ring() -> None:
    results = spawn(2, _exchange, timeout=120)
    assert results == {0: [True] * 6, 1: [True] * 6}


def _errors(rank: int) -> dict[str, str]:
    sm = connect(dist.group.WORLD, rank, [0, 1])
    assert sm is not None
    peer, seen = 1 - rank, {}
    if rank == 0:
        start = time.monotonic()
        try:
            sm.irecv(torch.empty(4), peer, "fwd", 3).wait(timedelta(seconds=0.6))
        except RuntimeError as error:
            seen["timeout"] = f"{error} after {time.monotonic() - start:.1f}"
        dist.barrier()
        sm.isend(torch.zeros(3), peer, "fwd", 4)  # 12 bytes where 16 are expected
        dist.barrier()
        try:
            sm.irecv(torch.empty(4), peer, "bwd", 5).wait(timedelta(seconds=30))
        except RuntimeError as error:
            seen["closed"] = str(error)
        return seen
    dist.barrier()
    try:
        sm.irecv(torch.empty(4), peer, "fwd", 4).wait(timedelta(seconds=30))
    except RuntimeError as error:
        seen["shape"] = str(error)
    dist.barrier()
    time.sleep(0.3)  # rank 0 waits by now
    sm.close()
    return seen


def test_a_wait_ends_with_the_error_the_pipe_reports() -> None:
    results = spawn(2, _errors, timeout=120)
    assert results[0]["timeout"].startswith("timed out after 0.6 s waiting for rank 1")
    assert 0.5 < float(results[0]["timeout"].rpartition(" ")[2]) < 3
    assert results[1]["shape"].startswith("rank 0 sent 12 bytes where 16 were expected")
    assert results[0]["closed"] == "Connection closed by peer: rank 1 left the pipeline"


def _switched_off(rank: int) -> bool:
    return connect(dist.group.WORLD, rank, [0, 1]) is None


def test_it_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPAR_SHARED_MEMORY", "0")  # the ranks get the caller's environment
    assert spawn(2, _switched_off) == {0: True, 1: True}
