"""``to`` / ``cuda`` / ``cpu`` on a pipe across ranks (pipepar.distributed.pipe), as training
loops and libraries call them before training: a no-op where the rank computes already (``cpu``
and ``cpu:0`` alike, as accelerate names the CPU under torchrun), a ValueError naming the move
otherwise; before, the call tried to move the other ranks' weights, kept on ``meta``, and
failed ("Cannot copy out of meta tensor"). Training after it equals the plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._ranks import spawn
from tests._small_models import TiedEnds

pytestmark = pytest.mark.slow

IDS = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _moved(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = TiedEnds(blocks=4)
    plain = copy.deepcopy(model)
    pipe = ppd.wrap(model, split=["blocks.2"], chunks=2, schedule="1f1b", timeout=120)
    same = [pipe.to("cpu"), pipe.to(torch.device("cpu", 0)), pipe.cpu(), pipe.to(device="cpu")]
    try:
        pipe.to("meta")
        refused = ""
    except ValueError as error:
        refused = str(error)
    loss = pipe.step(IDS, loss_fn=_loss, target=IDS)
    expected = _loss(plain(IDS), IDS)
    expected.backward()
    mine = dict(pipe.named_parameters())
    grads = {n: (p.grad, dict(plain.named_parameters())[n].grad) for n, p in mine.items()}
    pipe.close()
    return {
        "same": all(p is pipe for p in same),
        "refused": refused,
        "loss": (float(loss), float(expected)),
        "grads": grads,
    }


def test_moving_a_pipe_across_ranks_to_where_it_is_does_nothing() -> None:
    for rank, out in spawn(2, _moved).items():
        assert out["same"], rank
        assert "to(device)" in out["refused"] and "meta" in out["refused"], rank
        assert out["loss"][0] == pytest.approx(out["loss"][1], rel=1e-6)
        for name, (ours, theirs) in out["grads"].items():
            torch.testing.assert_close(ours, theirs, msg=f"rank {rank} {name}")
