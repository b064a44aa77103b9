"""A layer's backward as it runs: activations freed, parameter gradients made, in step.

Only activations shrink with the micro-batch; parameter gradients do not. A backward frees the
layer's saved activations while it makes its gradients, so its peak at a fraction ``r`` of the
profiled batch is not ``r`` times the profiled peak plus the gradients (too much for a layer
with large weights and a small micro-batch: the profiled peak came when the activations were
partly freed). :class:`BackwardClock` keeps the whole trade-off as a few points
``(other bytes, gradient bytes)``; at ``r`` the peak is ``max(r * other + gradients)``.

It also keeps the points of the same backward as if nothing alive before it were freed: a
backward that keeps its graph (``retain_graph``), as B of a zero-bubble split does when W must
run autograd again.

A gradient is allocated before its hook says it is one: in between it is counted as a
gradient, not as other bytes (else a matrix product's weight gradient, which the runtime may
add into its sum in place, would pass for work space that scales with the micro-batch).

    >>> with BackwardClock(tracker, weights, base) as clock:
    ...     torch.autograd.grad(outputs, inputs + weights, grads)
    >>> clock.points()
"""

from __future__ import annotations

from typing import Any

import torch

from pipepar.planner.memory_tracker import MemoryTracker, storage_key

__all__ = ["BackwardClock", "Points", "lift", "top"]

Points = tuple[tuple[int, int], ...]
"""``(other bytes, gradient bytes)`` pairs, gradients ascending, no pair above another in both."""


class BackwardClock:
    """Notes, at every change of the tracker's live total and whenever a weight's gradient is
    made (a hook on the weight), the bytes above ``base``: parameter gradients made so far, and
    the rest (activations not yet freed, incoming and intermediate gradients, work space).

    Args:
        tracker: the tracker that sees the backward's allocations.
        weights: the parameters whose gradients the backward makes.
        base: the live total the bytes are counted from.
    """

    def __init__(self, tracker: MemoryTracker, weights: list[torch.Tensor], base: int) -> None:
        self.tracker, self.weights, self.base = tracker, weights, base
        self.grads = 0
        self.freed = 0  # bytes freed that were alive when the backward began
        self.notes: list[tuple[int, int, int]] = []  # (gradients made, other, other if kept)
        self.born: dict[int, int] = {}  # storage -> the note of its allocation
        self.early: list[tuple[int, int, int]] = []  # a gradient's (born, made) notes, bytes
        self.before: set[int] = set()
        self.handles: list[Any] = []

    def __enter__(self) -> BackwardClock:
        self.before = self.tracker.live_keys()
        self.handles = [w.register_hook(self._made) for w in self.weights]
        self.tracker.on_change = self._changed
        self._note()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.on_change = None
        for handle in self.handles:
            handle.remove()

    def _made(self, grad: torch.Tensor) -> None:
        nbytes = grad.numel() * grad.element_size()
        born = self.born.pop(storage_key(grad), None)
        if born is not None:
            self.early.append((born, len(self.notes), nbytes))
        self.grads += nbytes
        self._note()

    def _changed(self, key: int, delta: int) -> None:
        # A key is a storage's address: once freed, a new storage may take it, and must not
        # count as one that was alive before the backward.
        if delta < 0 and key in self.before:
            self.freed -= delta
            self.before.discard(key)
        if delta > 0:
            self.before.discard(key)
            self.born[key] = len(self.notes)
        self._note()

    def _note(self) -> None:
        other = self.tracker.live_bytes - self.base - self.grads
        self.notes.append((self.grads, other, other + self.freed))

    def _seen(self, kept: bool) -> dict[int, int]:
        """Gradients made -> the most other bytes meanwhile, gradients not yet handed to
        their hook moved from other bytes to gradients."""
        seen: dict[int, int] = {}
        for i, (grads, other, other_kept) in enumerate(self.notes):
            early = sum(n for born, made, n in self.early if born <= i < made)
            key, value = grads + early, (other_kept if kept else other) - early
            seen[key] = max(seen.get(key, value), value)
        return seen

    def points(self) -> Points:
        """The backward's points."""
        return _frontier(self._seen(False))

    def retained_points(self) -> Points:
        """The points of the same backward keeping its graph."""
        return _frontier(self._seen(True))


def _frontier(seen: dict[int, int]) -> Points:
    out: list[tuple[int, int]] = []
    for grads in sorted(seen, reverse=True):
        if not out or seen[grads] > out[-1][0]:
            out.append((seen[grads], grads))
    return tuple(reversed(out))


def top(points: Points) -> int:
    """The highest total of the points (their peak at the profiled batch)."""
    return max((a + g for a, g in points), default=0)


def lift(points: Points, retained: Points, peak: int) -> tuple[Points, Points]:
    """Both point sets raised by what ``peak``, measured by a device's allocator, exceeds the
    points' own top: kernel work space no dispatch mode sees (taken to scale with the batch).

    Example:
        >>> lift(((10, 0), (4, 8)), ((12, 8),), 16)
        (((14, 0), (8, 8)), ((16, 8),))
    """
    if not points:
        return ((peak, 0),), retained or ((peak, 0),)
    short = max(0, peak - top(points))
    return tuple((a + short, g) for a, g in points), tuple((a + short, g) for a, g in retained)
