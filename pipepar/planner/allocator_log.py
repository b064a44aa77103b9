"""CPU allocator events from ``torch.profiler``: peaks of allocated bytes inside time windows.

The CPU allocator reports every allocation and free to the profiler when it runs with
``profile_memory=True``, including scratch buffers that kernels allocate and free inside one op
(which a dispatch mode cannot see). Replaying those events in time order gives the allocated
total at every moment; named ``record_function`` ranges mark the windows of interest.

    >>> with AllocatorLog() as log:
    ...     with torch.profiler.record_function("pipepar:work"):
    ...         y = torch.ones(1024) * 2
    >>> log.window("pipepar:work").rise >= 4096
    True
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocatorLog", "Window"]


@dataclass(frozen=True)
class Window:
    """Allocated bytes around one named range, relative to the total at its start.

    Attributes:
        rise: the highest total inside the window minus the total at its start.
        net: the total at its end minus the total at its start.
    """

    rise: int
    net: int


class AllocatorLog:
    """Record CPU allocations while active; then ask for the peak of any named window."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._times: list[int] = []
        self._totals: list[int] = []
        self._ranges: dict[str, tuple[int, int]] = {}

    def __enter__(self) -> AllocatorLog:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        from torch._C._profiler import _ExtraFields_Allocation

        events: list[tuple[int, int]] = []
        profiler = self._prof.profiler
        results = profiler.kineto_results if profiler is not None else None
        stack = list(results.experimental_event_tree()) if results is not None else []
        while stack:
            node = stack.pop()
            fields = node.extra_fields
            if isinstance(fields, _ExtraFields_Allocation):
                if fields.device.type == "cpu":
                    events.append((node.start_time_ns, fields.alloc_size))
            elif node.name.startswith("pipepar:"):
                self._ranges[node.name] = (node.start_time_ns, node.end_time_ns)
            stack.extend(node.children)
        events.sort(key=lambda e: e[0])  # stable: same-time events keep their recorded order
        self._times = [t for t, _ in events]
        self._totals = list(accumulate(size for _, size in events))

    @property
    def largest_rise(self) -> int:
        """The highest allocated total over the whole log, relative to its start."""
        return max([0, *self._totals])

    @property
    def net_bytes(self) -> int:
        """Allocated bytes at the end of the log, relative to its start."""
        return self._totals[-1] if self._totals else 0

    def window(self, name: str) -> Window:
        """Rise and net change of allocated bytes inside the ``record_function`` range ``name``."""
        if name not in self._ranges:
            return Window(0, 0)
        start, end = self._ranges[name]
        lo = bisect.bisect_left(self._times, start)
        hi = bisect.bisect_right(self._times, end)
        base = self._totals[lo - 1] if lo > 0 else 0
        inside = self._totals[lo:hi]
        top = max(inside, default=base)
        last = inside[-1] if inside else base
        return Window(rise=max(0, top - base), net=last - base)
