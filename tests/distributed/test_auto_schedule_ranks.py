"""``pipepar.distributed.wrap(schedule="auto", memory_budget=...)`` on two gloo ranks: every
rank builds the same schedule from the same description, within the budget, and training
gives the plain model's loss and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

WIDTH, ROWS, CHUNKS = 6, 8, 4


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _rank(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    out: dict[str, Any] = {}
    for budget in ("50%", 2):
        pipe = ppd.wrap(_model(), [2, 2, 2, 2], chunks=CHUNKS, schedule="auto",
                        memory_budget=budget, checkpoint="never")  # fmt: skip
        x, y = _batch()
        loss = pipe.step(x, y, nn.functional.mse_loss)
        s = pipe.schedule
        out[str(budget)] = {
            "loss": float(loss),
            # arrays, not tensors: a tensor crosses the queue as a file descriptor the rank
            # must still be alive to hand over
            "grads": {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()},
            "actions": [[repr(a) for a in s.worker(w)] for w in range(s.n_workers)],
            "placement": list(s.placement),
            "held": max(s.worker_held(w, [0.5] * 4) for w in range(s.n_workers)),
        }
        pipe.close()
    return out


def test_every_rank_builds_the_same_schedule_and_matches_the_plain_model() -> None:
    from tests._ranks import spawn

    got = spawn(2, _rank)
    plain = _model()
    x, y = _batch()
    ref = nn.functional.mse_loss(plain(x), y)
    ref.backward()
    grads = dict(plain.named_parameters())
    for budget, most in (("50%", 1.0), ("2", 2.0)):
        first, second = got[0][budget], got[1][budget]
        assert first["actions"] == second["actions"] and first["placement"] == second["placement"]
        assert first["held"] <= most
        for r in (0, 1):
            assert abs(got[r][budget]["loss"] - ref.item()) < 1e-5
            for name, g in got[r][budget]["grads"].items():
                torch.testing.assert_close(
                    torch.from_numpy(g), grads[name].grad, rtol=1e-5, atol=1e-6
                )
        assert set(first["grads"]) | set(second["grads"]) == set(grads)
