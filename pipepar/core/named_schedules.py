"""The named schedules: GPipe, 1F1B, ZB-H1, ZB-V, V-Half, V-Min and interleaved 1F1B, built for
a number of stages and micro-batches, and :func:`make`, which builds one by its name.

Each builder returns a :class:`~pipepar.core.schedule.Schedule` (the action lists as data); the
zero-bubble ones and interleaved 1F1B with a micro-batch count that is not a multiple of the
workers are list-scheduled (:mod:`pipepar.core.schedule_greedy`); V-Half and V-Min take the
faster of a repeated building block (:mod:`pipepar.core.schedule_blocks`) and list scheduling
under their memory bound.

    >>> [str(a) for a in one_f_one_b(3, 4).stage(0)]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
"""

from __future__ import annotations

from functools import lru_cache

from pipepar.core.schedule import Action, Schedule, timed, validate
from pipepar.core.schedule_blocks import STYLES, held, repeated, v_block
from pipepar.core.schedule_greedy import Cost, greedy_orders, unit_cost

__all__ = [
    "NAMES",
    "VIRTUAL",
    "gpipe",
    "interleaved_1f1b",
    "make",
    "n_workers",
    "one_f_one_b",
    "v_half",
    "v_min",
    "zb_h1",
    "zb_v",
]


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """Fill-drain: every stage runs all forwards, then all backwards (last micro-batch first).

    Holds all ``M`` micro-batches' activations on every stage.

    Example:
        >>> [str(a) for a in gpipe(2, 3).stage(1)]
        ['F0', 'F1', 'F2', 'B2', 'B1', 'B0']
    """
    k, m = _check_sizes(n_stages, n_microbatches)
    actions = tuple(
        tuple(Action(j, "F", i) for i in range(m))
        + tuple(Action(j, "B", i) for i in reversed(range(m)))
        for j in range(k)
    )
    return Schedule("gpipe", k, m, actions, max_in_flight=(m,) * k)


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B: a warm-up of ``K-1-j`` forwards on stage ``j``, then alternate one F and one B.

    Stage ``j`` holds at most ``min(K - j, M)`` micro-batches of activations at once.

    Example:
        >>> [str(a) for a in one_f_one_b(3, 4).stage(0)]
        ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    k, m = _check_sizes(n_stages, n_microbatches)
    per_stage = []
    for j in range(k):
        warmup = min(k - 1 - j, m)
        work = [Action(j, "F", i) for i in range(warmup)]  # warm-up
        for i in range(m - warmup):  # steady state: one forward, one backward
            work += [Action(j, "F", warmup + i), Action(j, "B", i)]
        work += [Action(j, "B", i) for i in range(m - warmup, m)]  # cool-down
        per_stage.append(tuple(work))
    bound = tuple(min(k - j, m) for j in range(k))
    return Schedule("1f1b", k, m, tuple(per_stage), max_in_flight=bound)


def zb_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order and memory bound, backward split into B and W; each stage runs its
    W's in the time it would idle, so about a third of 1F1B's bubble is left.

    Example:
        >>> s = zb_h1(2, 4)
        >>> [str(a) for a in s.stage(1)][:6]
        ['F0', 'B0', 'W0', 'F1', 'B1', 'W1']
        >>> s.bubble() < one_f_one_b(2, 4).bubble()
        True
    """
    k, m = _check_sizes(n_stages, n_microbatches)
    bound = tuple(min(k - j, m) for j in range(k))
    return _greedy("zb-h1", tuple(range(k)), k, m, bound, split=True)


def zb_v(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-V: ``n_stages = 2K`` stages in a V over K workers (worker ``w`` holds stages ``w`` and
    ``2K-1-w``), backward split into B and W; 1F1B's activation memory and almost no bubble.

    Example:
        >>> s = zb_v(4, 8)
        >>> s.n_workers, s.stages_of(0)
        (2, [0, 3])
        >>> s.bubble() < 0.1
        True
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    k = _workers_for(n, 2, "zb-v", "a V of 2 stages per worker")
    placement = tuple(s if s < k else 2 * k - 1 - s for s in range(n))
    bound = (2 * k,) * k  # half-size stages: K full-stage micro-batches, as 1F1B's stage 0
    built = [_greedy("zb-v", placement, k, m, bound, split=True, cost=c) for c in _ZB_V_COSTS]
    return min(built, key=lambda s: max(timed(s, _first_free).values()))


def v_half(n_stages: int, n_microbatches: int) -> Schedule:
    """V-Half (Qi et al. 2024): ZB-V's V over K workers (worker ``w`` holds stages ``w`` and
    ``2K-1-w``), backward split into B and W, each worker holding at most ``K + 2`` half-stage
    micro-batches: ``K/2 + 1`` full-stage ones where 1F1B's first stage holds ``K``, half as
    much as K grows (3/4 on 4 workers; on 2, as much as 1F1B), at about 1F1B's step time.

    The fastest (timed as the runtime meets F, B and W) of the building blocks within the bound
    (:mod:`pipepar.core.schedule_blocks`) and list scheduling under it.

    Example:
        >>> s = v_half(8, 16)
        >>> s.max_in_flight, max(one_f_one_b(4, 16).max_in_flight or ())
        ((6, 6, 6, 6), 4)
        >>> max(s.worker_in_flight(w) for w in range(4))
        6
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    k = _workers_for(n, 2, "v-half", "a V of 2 stages per worker")
    return _v_bounded("v-half", k, m, k + 2)


def v_min(n_stages: int, n_microbatches: int) -> Schedule:
    """V-Min (Qi et al. 2024): ZB-V's V over K workers, backward split into B and W, each
    worker holding the fewest half-stage micro-batches that a building block repeated without
    idle slots reaches here (with F = B = W): ``2 * ((K + 4) // 3)`` for K >= 3, i.e.
    ``(K + 4) // 3`` full-stage ones against 1F1B's ``K`` (a third as K grows, half on 4 to 8
    workers); 3 on 2 workers (3/4). About 1F1B's step time: a little faster with few
    micro-batches, a few percent slower with many (the block assumes F = B = W). The faster of
    that block and list scheduling under the same bound (it wins only with few micro-batches).

    Example:
        >>> [v_min(2 * k, 16).max_in_flight[0] for k in (2, 3, 4, 6, 8)]
        [3, 4, 4, 6, 8]
        >>> s = v_min(8, 16)
        >>> max(s.worker_in_flight(w) for w in range(4)), s.stages_of(0)
        (4, [0, 7])
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    k = _workers_for(n, 2, "v-min", "a V of 2 stages per worker")
    return _v_bounded("v-min", k, m, _least_held(k))


def _least_held(k: int) -> int:
    return min(held(v_block(k, style), k) for style in STYLES)


@lru_cache(maxsize=256)  # a search asks again for each layout; the build times many orders
def _v_bounded(name: str, k: int, m: int, bound: int) -> Schedule:
    """The fastest V schedule found with every worker holding at most ``bound`` half-stage
    micro-batches: the building blocks within it, and list scheduling under it."""
    placement = tuple(s if s < k else 2 * k - 1 - s for s in range(2 * k))
    bounds = (bound,) * k
    built = [
        _from_orders(name, placement, m, repeated(v_block(k, style), k, m), bounds)
        for style in STYLES
        if held(v_block(k, style), k) <= bound
    ]
    for cost in _ZB_V_COSTS:
        try:
            orders = greedy_orders(placement, k, m, bounds, split=True, cost=cost, reserve=True)
        except ValueError:  # this cost model's order cannot progress under the bound
            continue
        built.append(_from_orders(name, placement, m, orders, bounds))
    return min(built, key=lambda s: max(timed(s, _first_free).values()))


def _first_free(a: Action, split: bool) -> float:
    """Costs as the runtime meets them with matrix-product layers: F, B and W one product per
    layer, W a bit cheaper (no elementwise backward); the first stage's input needs no gradient,
    so its B computes nothing and its W is the whole backward."""
    if a.kind == "F":
        return 1.0
    if a.stage == 0:
        return 0.0 if a.kind == "B" and split else 1.75
    return 1.0 if a.kind == "B" and split else 0.75 if a.kind == "W" else 1.75


def _costs(first_b: float, w: float, first_w: float) -> Cost:
    def cost(stage: int, kind: str, split: bool) -> float:
        if kind == "F":
            return 1.0
        if kind == "W":
            return first_w if stage == 0 else w
        return first_b if stage == 0 else 1.0

    return cost


_ZB_V_COSTS: tuple[Cost, ...] = (unit_cost, _costs(0.0, 1.0, 2.0), _costs(0.5, 0.7, 1.4))
"""Cost models zb-v list-schedules with; it keeps the order that :func:`_first_free` times
shortest. Unit costs alone misjudge the first stage (its B is free, its W whole) and the
cheaper W: on 2 workers, M = 8 that order idles worker 1 ~4% of the step (measured 7% slower
than the best of these in one A/B on the CPU benchmark, python benchmarks/bench_schedules.py)."""


def interleaved_1f1b(n_stages: int, n_microbatches: int, *, n_workers: int) -> Schedule:
    """Interleaved 1F1B: ``n_stages = V*K`` stages looped over K workers (stage ``s`` on worker
    ``s % K``); the bubble shrinks by V at the cost of more activations in flight. With ``M`` not
    a multiple of ``K`` the order comes from list scheduling (as zero-bubble's does).

    Example:
        >>> s = interleaved_1f1b(4, 4, n_workers=2)
        >>> s.stages_of(1), s.bubble() < one_f_one_b(2, 4).bubble()
        ([1, 3], True)
    """
    n, m = _check_sizes(n_stages, n_microbatches)
    k, v = n_workers, n_stages // max(1, n_workers)
    if k < 1 or n % k or v < 2:
        raise ValueError(
            f"interleaved-1f1b needs a multiple of the {k} workers, at least 2 stages each, but "
            f"got {n} stages; pass balance with {2 * max(k, 1)} entries (2 stages per worker)"
        )
    placement = tuple(s % k for s in range(n))
    if m % k:  # the looped order needs whole groups of K micro-batches; list-schedule instead
        return _greedy("interleaved-1f1b", placement, k, m, (m * v,) * k, split=False)
    actions = tuple(tuple(_looped_order(w, k, v, m)) for w in range(k))
    return Schedule("interleaved-1f1b", n, m, actions, placement)


def _looped_order(w: int, k: int, v: int, m: int) -> list[Action]:
    """Worker ``w``'s interleaved 1F1B list (Narayanan et al. 2021): micro-batches go through
    the worker's stages in groups of K; after a warm-up, one forward and one backward alternate."""
    groups = [range(g, min(m, g + k)) for g in range(0, m, k)]
    fwd = [Action(c * k + w, "F", i) for grp in groups for c in range(v) for i in grp]
    bwd = [Action(c * k + w, "B", i) for grp in groups for c in reversed(range(v)) for i in grp]
    warmup = min(len(fwd), (k - w - 1) * 2 + (v - 1) * k)
    order = fwd[:warmup]  # warm-up
    for f, b in zip(fwd[warmup:], bwd):  # steady state: one forward, one backward
        order += [f, b]
    return order + bwd[len(fwd) - warmup :]  # cool-down


NAMES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half", "v-min")
"""Schedule names that :func:`make`, ``pipepar.wrap`` and ``pipepar.distributed.wrap`` accept."""

VIRTUAL = ("interleaved-1f1b", "zb-v", "v-half", "v-min")
"""Names whose balance lists several stages per worker."""


def n_workers(schedule: object, n_stages: int, *, per: str = "worker") -> int:
    """Workers (devices or ranks) for ``n_stages`` stages: one per stage, or one per 2 stages
    for the virtual-stage schedules (a :class:`Schedule` says itself).

    Args:
        schedule: a name or a Schedule.
        n_stages: entries of the balance.
        per: what a worker is called in the error, e.g. ``"rank"``.

    Raises:
        ValueError: a virtual-stage schedule with an odd number of stages.

    Example:
        >>> n_workers("zb-v", 4), n_workers("1f1b", 4)
        (2, 4)
    """
    if isinstance(schedule, Schedule):
        return schedule.n_workers
    if schedule not in VIRTUAL:
        return n_stages
    if n_stages % 2:
        sizes = " or ".join(str(n) for n in (n_stages - 1, n_stages + 1) if n > 0)
        raise ValueError(
            f"schedule {schedule!r} runs 2 stages per {per}, but balance has {n_stages} stages; "
            f"pass balance with {sizes} entries ({per}s per pipeline = len(balance) // 2), or "
            f"a schedule with one stage per {per} such as '1f1b'"
        )
    return n_stages // 2


def make(name: str | Schedule, n_stages: int, n_microbatches: int, *, n_workers: int) -> Schedule:
    """The schedule called ``name`` for ``n_stages`` stages on ``n_workers`` workers.

    A :class:`Schedule` is checked against the sizes and returned.

    Raises:
        ValueError: for an unknown name (listing the names), sizes that do not fit the schedule,
            or a Schedule built for other sizes.

    Example:
        >>> make("zb-v", 4, 8, n_workers=2).n_workers
        2
    """
    if isinstance(name, Schedule):
        return _check_given(name, n_stages, n_microbatches, n_workers)
    if name not in NAMES:
        raise ValueError(
            f"schedule must be one of {list(NAMES)} or a pipepar Schedule, but got {name!r}; "
            "'1f1b' holds fewer activations than 'gpipe', 'zb-v' leaves the smallest bubble"
        )
    return _named(name, n_stages, n_microbatches, n_workers)


@lru_cache(maxsize=256)  # a search, a fit and a plan's step time ask again for each layout
def _named(name: str, n_stages: int, n_microbatches: int, n_workers: int) -> Schedule:
    """The schedule ``name`` (one of :data:`NAMES`) built and checked against the workers:
    made once, a frozen schedule shared by every caller."""
    if name == "interleaved-1f1b":
        schedule = interleaved_1f1b(n_stages, n_microbatches, n_workers=n_workers)
    else:
        schedule = _BUILDERS[name](n_stages, n_microbatches)
    if schedule.n_workers != n_workers:
        raise ValueError(
            f"schedule {name!r} with {n_stages} stages runs on {schedule.n_workers} workers but "
            f"there are {n_workers} devices or ranks; "
            + (
                f"pass balance with {2 * n_workers} entries (2 stages per worker)"
                if name in VIRTUAL
                else f"pass one device per stage ({n_stages})"
            )
        )
    return schedule


_BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "v-half": v_half,
    "v-min": v_min,
}


def _check_given(schedule: Schedule, n: int, m: int, k: int) -> Schedule:
    got = (schedule.n_stages, schedule.n_microbatches, schedule.n_workers)
    if got != (n, m, k):
        raise ValueError(
            f"schedule is for {got[0]} stages x {got[1]} micro-batches on {got[2]} workers, but "
            f"the pipe has {n} stages, chunks={m} and {k} devices or ranks; build it for those"
        )
    validate(schedule)
    return schedule


def _greedy(
    name: str,
    placement: tuple[int, ...],
    k: int,
    m: int,
    bound: tuple[int, ...],
    *,
    split: bool,
    cost: Cost = unit_cost,
) -> Schedule:
    orders = greedy_orders(placement, k, m, bound, split=split, cost=cost)
    return _from_orders(name, placement, m, orders, bound)


def _from_orders(
    name: str,
    placement: tuple[int, ...],
    m: int,
    orders: list[list[tuple[int, str, int]]],
    bound: tuple[int, ...],
) -> Schedule:
    actions = tuple(tuple(Action(s, kind, i) for s, kind, i in work) for work in orders)  # type: ignore[arg-type]
    return Schedule(name, len(placement), m, actions, placement, max_in_flight=bound)


def _workers_for(n: int, v: int, name: str, shape: str) -> int:
    if n % v or n < v:
        raise ValueError(
            f"{name} runs {shape}, so balance needs a multiple of {v} entries, but got {n} "
            f"stages; pass e.g. {v * max(1, n // v)} stages ({v} per device or rank)"
        )
    return n // v


def _check_sizes(n_stages: int, n_microbatches: int) -> tuple[int, int]:
    for label, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}; pass e.g. 4")
        if value < 1:
            raise ValueError(f"{label} must be at least 1, got {value}; pass e.g. 4")
    return n_stages, n_microbatches
