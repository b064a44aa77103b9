"""Schedules built by repeating one micro-batch's passes: a *building block* (Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory").

In a V over K workers (worker ``w`` holds stages ``w`` and ``2K-1-w``) each worker runs six
passes per micro-batch: F, B and W on each of its two stages. The block gives each pass of
micro-batch 0 a slot on a unit clock; micro-batch ``i`` repeats the block ``6i`` slots later.
If a worker's six passes fall on six different slots modulo 6, the repeats never collide and
the steady state has no idle slot. A worker holds a stage's micro-batch from its F to its W
(the block's *lifespan* on that stage), so the micro-batches it holds at once in the steady
state follow from the lifespans alone: about ``(lifespan_a + lifespan_b) / 6``. Short lifespans
are little memory; the order of each worker is the block's passes sorted by slot, and the
runtimes then run each action as soon as what it waits for is done (the warm-up and cool-down
squeeze themselves).

Two ways to fill the block are built here, both first-fit (each pass in the first slot at or
after the one it waits for whose residue its worker has free):

- ``"chained"``: F up the V, then B down it, each W placed right after its B (the chain's next
  B may be pushed later by it);
- ``"tight"``: F up and B down first, the W's in the slots left, each worker choosing the pair
  of W slots that holds the fewest micro-batches (the chain is never delayed; with F = B = W
  this holds the fewest micro-batches of the two for K >= 3).

    >>> block = v_block(2, "tight")
    >>> block[(0, "F")], block[(3, "B")], held(block, 2)
    (0, 4, 4)
"""

from __future__ import annotations

import itertools
from functools import lru_cache

__all__ = ["INTERVAL", "STYLES", "held", "repeated", "v_block"]

INTERVAL = 6
"""Slots between two micro-batches' blocks: a worker's six passes (F, B, W on two stages)."""

STYLES = ("chained", "tight")
"""How :func:`v_block` fills the block (see the module docstring)."""

Pass = tuple[int, str]  # (stage, kind)
Op = tuple[int, str, int]  # (stage, kind, micro-batch)


def _worker(k: int, s: int) -> int:
    return s if s < k else 2 * k - 1 - s


@lru_cache(maxsize=64)
def v_block(k: int, style: str) -> dict[Pass, int]:
    """The slot of every pass of micro-batch 0 in a V over ``k`` workers.

    Args:
        k: workers (the V has ``2k`` stages).
        style: one of :data:`STYLES`.

    Example:
        >>> b = v_block(2, "chained")
        >>> sorted(b.items(), key=lambda kv: kv[1])[:5]
        [((0, 'F'), 0), ((1, 'F'), 1), ((2, 'F'), 2), ((3, 'F'), 3), ((3, 'B'), 4)]
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {list(STYLES)}, got {style!r}")
    used: list[set[int]] = [set() for _ in range(k)]
    slots: dict[Pass, int] = {}
    t = 0
    for s in range(2 * k):  # F up the V
        t = _place(slots, used, k, (s, "F"), t) + 1
    for s in reversed(range(2 * k)):  # B down the V
        t = _place(slots, used, k, (s, "B"), t) + 1
        if style == "chained":
            _place(slots, used, k, (s, "W"), t)
    if style == "tight":
        for w in range(k):
            _place_weights(slots, used[w], k, w)
    return dict(slots)


def _place(slots: dict[Pass, int], used: list[set[int]], k: int, p: Pass, t: int) -> int:
    """Put pass ``p`` in the first slot from ``t`` whose residue its worker has free."""
    taken = used[_worker(k, p[0])]
    while t % INTERVAL in taken:
        t += 1
    taken.add(t % INTERVAL)
    slots[p] = t
    return t


def _place_weights(slots: dict[Pass, int], taken: set[int], k: int, w: int) -> None:
    """Worker ``w``'s two W's in its two free residues: the pairing that holds the fewest."""
    stages = (w, 2 * k - 1 - w)
    free = [r for r in range(INTERVAL) if r not in taken]
    best: tuple[tuple[int, int], dict[Pass, int]] | None = None
    for residues in itertools.permutations(free):
        trial = dict(slots)
        for s, r in zip(stages, residues):
            after = slots[(s, "B")] + 1
            trial[(s, "W")] = after + (r - after) % INTERVAL
        key = (_held_by(trial, stages), sum(trial[(s, "W")] for s in stages))
        if best is None or key < best[0]:
            best = (key, trial)
    assert best is not None  # two free residues: at least one pairing
    slots.update(best[1])
    taken.update(free)


def _held_by(slots: dict[Pass, int], stages: tuple[int, ...]) -> int:
    """Most micro-batches the stages hold at once in the steady state (F to end of W)."""
    spans = [(slots[(s, "F")], slots[(s, "W")] + 1) for s in stages]
    return max(
        sum((t - f) // INTERVAL - (t - e) // INTERVAL for f, e in spans) for t in range(INTERVAL)
    )


def held(block: dict[Pass, int], k: int) -> int:
    """Most stage micro-batches any worker holds at once when the block repeats.

    Example:
        >>> held(v_block(4, "tight"), 4)  # 1F1B's first stage holds 4 full = 8 half stages
        4
    """
    return max(_held_by(block, (w, 2 * k - 1 - w)) for w in range(k))


def repeated(block: dict[Pass, int], k: int, m: int) -> list[list[Op]]:
    """Per worker, ``(stage, kind, micro-batch)`` in slot order: the block once per micro-batch,
    each ``INTERVAL`` slots after the previous.

    Example:
        >>> repeated(v_block(2, "tight"), 2, 1)[0]
        [(0, 'F', 0), (3, 'F', 0), (3, 'B', 0), (3, 'W', 0), (0, 'B', 0), (0, 'W', 0)]
    """
    timed = sorted(
        (t + INTERVAL * i, s, kind, i) for (s, kind), t in block.items() for i in range(m)
    )
    orders: list[list[Op]] = [[] for _ in range(k)]
    for _, s, kind, i in timed:
        orders[_worker(k, s)].append((s, kind, i))
    return orders
