"""The receives a rank posts ahead of their messages, read off the schedule
(:mod:`pipepar.planner.posted_receives`), and the device peaks that count them
(``MemoryModel(..., ranks=...)``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipepar.core.named_schedules import gpipe, make
from pipepar.planner.peak_moments import moments
from pipepar.planner.posted_receives import CHAIN, PROGRAM, PostedReceives
from pipepar.planner.profile import profile
from pipepar.planner.stage_memory import MemoryModel, StageMemory

OUT, IN = 1000, 7  # a stage's output and input bytes per micro-batch (told apart in sums)


def _posted(kind: object, name: str, k: int, m: int, w: int) -> list[tuple[str, int]]:
    schedule = make(name, k, m, n_workers=k) if name != "gpipe" else gpipe(k, m)
    posted = PostedReceives(kind, schedule)  # type: ignore[arg-type]
    edges = [(IN, OUT)] * len(schedule.stages_of(w))
    walk = moments(schedule, w, "never", splits=(True,) * len(edges))
    return [(x.kind, posted.bytes(w, x, edges)) for x in walk]


def test_the_program_holds_a_gradient_receive_per_micro_batch_awaiting_its_backward() -> None:
    """1F1B on 2 ranks: stage 0 holds two micro-batches; the forward of the second has both
    their gradient receives posted (its own once its value leaves), a backward the other
    one's (its own gradient is the incoming one, counted by the stage's figures)."""
    got = _posted(PROGRAM, "1f1b", 2, 4, 0)
    assert max(b for _, b in got) == 2 * OUT
    assert {b for kind, b in got if kind in ("backward", "backward_end")} <= {0, OUT}
    assert ("backward", OUT) in got
    # The last stage sends nothing on; it receives activations only when its forward asks.
    assert {b for _, b in _posted(PROGRAM, "1f1b", 2, 4, 1)} == {0}


def test_the_program_posts_early_only_where_backwards_keep_the_forwards_order() -> None:
    """GPipe runs its backwards last micro-batch first: the runtime posts nothing early."""
    assert {b for _, b in _posted(PROGRAM, "gpipe", 2, 4, 0)} == {0}


def test_stages_on_one_rank_post_nothing_between_them() -> None:
    """ZB-V on 2 ranks: rank 1 holds stages 1 and 2, whose value is handed over in memory;
    only stage 2's output goes to another rank (stage 3 on rank 0)."""
    schedule = make("zb-v", 4, 4, n_workers=2)
    assert schedule.stages_of(1) == [1, 2]
    posted = PostedReceives(PROGRAM, schedule)
    walk = moments(schedule, 1, "never", splits=(True, True))
    assert {posted.bytes(1, x, [(IN, OUT), None]) for x in walk} == {0}
    assert max(posted.bytes(1, x, [None, (IN, OUT)]) for x in walk) > 0


def test_a_chain_posts_one_input_and_one_gradient_ahead() -> None:
    """An ``nn.Sequential`` across ranks posts the next forward's input once a forward ran,
    and the next backward's gradient once a backward ran: one of each at most."""
    first = _posted(CHAIN, "1f1b", 2, 4, 0)  # sends its output: gradients come back
    assert {b for _, b in first} == {0, OUT}
    last = _posted(CHAIN, "1f1b", 2, 4, 1)  # receives its input
    assert {b for _, b in last} == {0, IN}
    assert ("optimizer", 0) in last


def test_nothing_is_posted_at_the_optimizer_step() -> None:
    assert ("optimizer", 0) in _posted(PROGRAM, "1f1b", 2, 4, 0)


def _device_peak(ranks: str | None, w: int) -> int:
    torch.manual_seed(0)
    layers = [m for _ in range(2) for m in (nn.Linear(32, 32), nn.Tanh())]
    prof = profile(nn.Sequential(*layers), torch.randn(64, 32), device="meta", optimizer=None)
    memory = MemoryModel(prof, make("1f1b", 2, 4, n_workers=2), checkpoint="never",
                         foreach=[False, False], ranks=ranks)  # fmt: skip
    return sum(p.peak_bytes for p in memory.device(w, [[(0, 1), (2, 3)][w]]))


def test_a_ranks_peak_counts_its_posted_receives() -> None:
    """Across ranks the first device's peak grows by whole micro-batch outputs (16 rows x 32
    floats: 2 KiB each); the last device, which posts nothing early, keeps its peak."""
    grown = _device_peak("program", 0) - _device_peak(None, 0)
    assert grown > 0 and grown % (16 * 32 * 4) == 0
    assert _device_peak("program", 1) == _device_peak(None, 1)
    assert _device_peak("chain", 0) - _device_peak(None, 0) in (0, 16 * 32 * 4)


def test_an_unknown_runtime_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"ranks must be None .* got 'mpi'"):
        _device_peak("mpi", 0)


def test_posted_receives_are_the_holding_stages_not_the_acting_ones() -> None:
    """A device's peak split per stage gives the buffers to the stage that posted them (its
    activations, which a stage's own bound keeps whichever stage acts), not to the transient
    of the action running then."""
    layers = [m for _ in range(2) for m in (nn.Linear(32, 32), nn.Tanh())]
    prof = profile(nn.Sequential(*layers), torch.randn(64, 32), device="meta", optimizer=None)

    def first(ranks: str | None) -> StageMemory:
        memory = MemoryModel(prof, make("1f1b", 2, 4, n_workers=2), checkpoint="never",
                             foreach=[False, False], ranks=ranks)  # fmt: skip
        return memory.device(0, [(0, 1)])[0]

    alone, across = first(None), first("program")
    grown = across.activation_bytes - alone.activation_bytes
    assert grown > 0 and grown % (16 * 32 * 4) == 0
    assert across.transient_bytes == alone.transient_bytes


def test_the_layout_search_counts_them_for_ranks_only() -> None:
    """``search_layouts(..., ranks=...)`` (what ``pipepar.distributed.wrap(plan="auto")``
    asks) predicts the sending rank's peak with its posted receives; ``ranks=None`` (one
    process, ``pipepar.wrap``) without."""
    from pipepar.planner.cluster import cluster_for
    from pipepar.planner.layout_search import search_layouts

    layers = [m for _ in range(2) for m in (nn.Linear(32, 32), nn.Tanh())]
    search = dict(devices=2, batch=64, cluster=cluster_for(torch.device("cpu"), 2),
                  schedules=["1f1b"], chunks=[4], checkpoints=["never"], shards=(False,),
                  optimizer=None, top=None)  # fmt: skip

    def peaks(ranks: str | None) -> tuple[int, ...]:
        found = search_layouts(nn.Sequential(*layers), torch.randn(64, 32), **search,  # type: ignore[arg-type]
                               ranks=ranks)  # fmt: skip
        return next(x for x in found if x.pp == 2).peak_bytes

    alone, chain = peaks(None), peaks("chain")
    assert chain[0] - alone[0] == 16 * 32 * 4  # a gradient received ahead
    assert chain[1] - alone[1] == 16 * 32 * 4  # an input received ahead
    with pytest.raises(ValueError, match="ranks must be None"):
        peaks("mpi")
