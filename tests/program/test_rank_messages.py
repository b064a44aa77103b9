"""pipepar.program.rank_messages without a process group: a message's operations run outside
the Python modes of the code that sends it (a shadow stage's meta modes follow every operation
they see)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipepar.program.rank_messages import ACTIVATION, RankMessages, _bytes, _outside_modes


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Called(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _message(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_bytes(t.detach()) for t in ts])


def test_a_message_is_made_outside_the_callers_modes() -> None:
    ts = [torch.randn(2, 3), torch.arange(4)]
    with _Called() as called, _Seen() as seen:
        plain = _message(ts)
    assert seen.ops and called.calls  # what the modes see of a message made in the open
    with _Called() as called, _Seen() as seen:
        hidden = _outside_modes(_message)(ts)
    assert seen.ops == [] and called.calls == 0
    assert torch.equal(hidden, plain)


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


class _Progress:
    def __init__(self) -> None:
        self.failed: set[str] = set()

    def wait(self, work: _Work | None, what: str) -> None:
        if what in self.failed:
            raise RuntimeError(f"{what} failed")

    def wait_all(self, pending: list[tuple[_Work | None, str]]) -> None:
        while pending:
            self.wait(*pending.pop(0))


def _link() -> tuple[RankMessages, list[_Work], _Progress]:
    works: list[_Work] = []

    def isend(t: torch.Tensor, peer: int, group: Any, tag: int) -> _Work:
        works.append(_Work())
        return works[-1]

    progress = _Progress()
    mesh = SimpleNamespace(pipeline_ranks=[0, 1], fwd=None, bwd=None, progress=progress)
    mesh.isend = isend
    return RankMessages(mesh, torch.device("cpu"), [0, 1]), works, progress  # type: ignore[arg-type]


def test_a_send_that_has_left_lets_go_of_its_buffer_and_a_failed_one_raises() -> None:
    """The values sent in a step are not all kept to its end: each send lets go of the sends
    before it that have left (a 1F1B stage would otherwise hold every micro-batch's output);
    one that failed raises there, not later."""
    link, works, progress = _link()
    for _ in range(3):
        link.send(torch.randn(4, 4), ACTIVATION, 0, 1)
    assert len(link._buffers) == 3  # none has left yet
    works[0].done = works[1].done = True
    link.send(torch.randn(4, 4), ACTIVATION, 0, 1)
    assert len(link._buffers) == 2 and len(link._sends) == 2  # the third and the fourth
    works[2].done = True
    progress.failed.add(link._sends[0][1])
    with pytest.raises(RuntimeError, match="failed"):
        link.send(torch.randn(4, 4), ACTIVATION, 0, 1)
    link.drop()
    link.flush()  # nothing left to wait for


def test_a_send_still_on_its_way_keeps_no_later_send_that_left() -> None:
    """A send that reports itself done only once waited for (gloo's, to a rank further down
    the pipe) keeps its own buffer, not those of the messages sent after it that have left."""
    link, works, _ = _link()
    link.send(torch.arange(64), ACTIVATION, 0, 1)  # still on its way
    for _ in range(3):
        link.send(torch.randn(64, 64), ACTIVATION, 0, 1)
        works[-1].done = True  # left at once (shared memory copies it)
    link.send(torch.randn(64, 64), ACTIVATION, 0, 1)
    assert [b.numel() for b in link._buffers] == [64, 64 * 64]  # the first and the last
    assert [w for w, _ in link._sends] == [works[0], works[-1]]
