"""Hooks on the parameters across ranks (pipepar.core.parameter_hooks, program.rank_compute):
``p.register_hook`` runs once per step on each weight's whole gradient (a weight tied across
ranks: on its sum over them) and ``register_post_accumulate_grad_hook`` once its sum is in
``.grad``, so a clamping hook trains as on the plain model."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests._hooks import clamping_hooks
from tests._ranks import spawn
from tests._small_models import TiedEnds

pytestmark = pytest.mark.slow

LIMIT = 0.01  # below most gradients' largest entries: the clamp changes them
IDS = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))


def _loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _two_ranks(rank: int, schedule: str) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = TiedEnds(blocks=4)
    plain = copy.deepcopy(model)
    split = ["blocks.2"] if schedule == "1f1b" else ["blocks.1", "blocks.2", "blocks.3"]
    pipe = ppd.wrap(model, split=split, chunks=4, schedule=schedule, timeout=120)
    theirs, ours = clamping_hooks(plain, LIMIT), clamping_hooks(pipe, LIMIT)
    for _ in range(2):  # accumulated over two steps
        _loss(plain(IDS), IDS).backward()
        pipe.step(IDS, loss_fn=_loss, target=IDS)
    mine = dict(pipe.named_parameters())
    expected = {n: p.grad for n, p in plain.named_parameters() if n in mine}
    got = {n: p.grad for n, p in mine.items()}
    pipe.close()
    counts = {n: (ours[0][n], ours[1][n], theirs[0][n], theirs[1][n]) for n in mine}
    return {"expected": expected, "got": got, "counts": counts}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_parameter_hooks_across_ranks_run_once_on_the_whole_gradient(schedule: str) -> None:
    for rank, out in spawn(2, functools.partial(_two_ranks, schedule=schedule)).items():
        for name, g in out["got"].items():
            torch.testing.assert_close(g, out["expected"][name], msg=f"rank {rank} {name}")
        for name, (clamps, accumulated, *plain) in out["counts"].items():
            assert (clamps, accumulated) == (2, 2) == tuple(plain), (rank, name)
