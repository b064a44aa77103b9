"""pipepar.program.link without a process group: a message's operations run outside the Python
modes of the code that sends it (a shadow stage's meta modes follow every operation they see)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipepar.program.link import _bytes, _outside_modes


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
