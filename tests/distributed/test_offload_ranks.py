"""``pipepar.distributed.wrap(..., offload=True)`` on two gloo ranks: an ``nn.Sequential`` as a
chain and a model cut while it runs, under 1F1B and ZB-H1, step bit for bit as without
offload, and stage 0's rank sends its waiting micro-batches' activations out and has each back
before its backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._ranks import spawn
from tests._small_models import Residual

pytestmark = pytest.mark.slow

WIDTH, ROWS, M = 512, 256, 8  # a micro-batch's activation: 64 KiB, what the store sends


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def _run(rank: int, how: str, schedule: str, offload: bool) -> list[torch.Tensor]:
    import pipepar.distributed as ppd

    torch.manual_seed(1)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    if how == "chain":
        pipe = ppd.wrap(_chain(), balance=[4, 4], chunks=M, schedule=schedule, offload=offload)
        torch.manual_seed(2)
        loss = pipe.step(x if rank == 0 else None, y, nn.functional.mse_loss)
    else:
        pipe = ppd.wrap(
            Residual(WIDTH, WIDTH), split=["blocks.2"], chunks=M, schedule=schedule, offload=offload
        )
        torch.manual_seed(2)
        loss = pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    out = [torch.as_tensor(float(loss)), *grads]
    pipe.close()
    return out


def _both(rank: int) -> dict[str, Any]:
    from pipepar.core import offload_plan

    made: list[Any] = []
    init = offload_plan.Offloader.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    offload_plan.Offloader.__init__ = record  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for how in ("chain", "program"):
        for schedule in ("1f1b", "zb-h1"):
            kept = _run(rank, how, schedule, False)
            made.clear()
            sent = _run(rank, how, schedule, True)
            counts = [o.counts() for o in made]
            out[f"{how} {schedule}"] = (
                all(torch.equal(a, b) for a, b in zip(sent, kept, strict=True)),
                sum(c.sent for c in counts),
                sum(c.late for c in counts),
            )
    return out


def test_offload_across_ranks_steps_as_without_it() -> None:
    ranks = spawn(2, _both)
    for rank, results in ranks.items():
        for case, (equal, sent, late) in results.items():
            assert equal, f"rank {rank}, {case}: not as without offload"
            assert late == 0, f"rank {rank}, {case}: {late} bytes came back late"
            assert (sent > 0) == (rank == 0), f"rank {rank}, {case}: sent {sent} bytes"
