"""Three ranks, a weight tied between the first stage and the last: the group that sums its
gradient holds two of the ranks, yet every rank goes on making groups with the others as
before. A second pipe on the same ranks, and a group of the user's own, are made and used
(torch names each group from the count of groups its rank made: a rank that made one fewer
would give the next group another name and wait forever)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._ranks import spawn
from tests._small_models import TiedEnds

pytestmark = pytest.mark.slow

IDS = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _model() -> TiedEnds:
    torch.manual_seed(0)
    return TiedEnds()


def _three_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    out: dict[str, Any] = {}
    for schedule in ("1f1b", "gpipe"):  # the second pipe makes groups across all three
        pipe = ppd.wrap(_model(), split=["blocks.1", "blocks.2"], chunks=2, schedule=schedule,
                        timeout=120)  # fmt: skip
        out[schedule] = float(pipe.step(IDS, loss_fn=_loss, target=IDS))
        pipe.close()
    mine = dist.new_group([0, 1, 2], use_local_synchronization=True, timeout=timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total, group=mine)
    out["users group"] = float(total)
    return out


def test_every_rank_makes_its_next_groups_alike_after_a_tied_weights_group() -> None:
    got = spawn(3, _three_ranks, timeout=600)
    plain = _model()
    expected = float(_loss(plain(IDS), IDS))
    for rank in range(3):
        assert got[rank]["1f1b"] == pytest.approx(expected, rel=1e-6)
        assert got[rank]["gpipe"] == pytest.approx(expected, rel=1e-6)
        assert got[rank]["users group"] == 3.0
