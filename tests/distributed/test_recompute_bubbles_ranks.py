"""``recompute="bubbles"`` across ranks: every rank runs the same schedule with R actions, and
the results are the plain model's (batch norm) and bit-for-bit a pipe's that keeps every graph
(dropout); a model cut while it runs refuses it before any step."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests._ranks import spawn

pytestmark = pytest.mark.slow

LAYOUTS = {"1f1b": [3, 3], "zb-h1": [3, 3], "zb-v": [2, 1, 1, 2]}


def _model(dropout: float, norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Dropout(dropout),
        nn.BatchNorm1d(16) if norm else nn.Identity(),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    )


def _run(rank: int, schedule: str, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> dict[str, Any]:
    """One step of a pipe over the two ranks: its loss and this rank's gradients by name."""
    import pipepar.distributed as ppd

    pipe = ppd.wrap(
        _model(kw.pop("dropout", 0.0), kw.pop("norm", True)),
        LAYOUTS[schedule],
        chunks=4,
        schedule=schedule,
        batch_coupling="per-micro-batch",
        **kw,
    )
    listed = sum(a.kind == "R" for a in pipe.schedule.worker(rank))
    torch.manual_seed(7)
    loss = pipe.step(x if pipe.stage_index == 0 else None, y, nn.functional.mse_loss)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    stats = {n: b.clone() for n, b in pipe.named_buffers()}
    pipe.close()
    return {"loss": torch.as_tensor(loss), "grads": grads, "stats": stats, "listed": listed}


def _plain(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    model = _model(0.0)
    out = torch.cat([model(part) for part in x.chunk(4)])  # batch norm per micro-batch
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "stats": dict(model.named_buffers())}


def _gap(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """The largest difference of the loss, this rank's gradients and statistics."""
    gaps = [float((ours["loss"] - theirs["loss"]).abs())]
    for part in ("grads", "stats"):
        for name, t in ours[part].items():
            gaps.append(float((t.float() - theirs[part][name].float()).abs().max()))
    return max(gaps)


def _body(rank: int) -> dict[str, Any]:
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    plain = _plain(x, y)
    out: dict[str, Any] = {}
    for schedule in LAYOUTS:
        bubbles = _run(rank, schedule, x, y, checkpoint="always", recompute="bubbles")
        out[schedule, "listed"] = bubbles["listed"]
        out[schedule, "plain gap"] = _gap(bubbles, copy.deepcopy(plain))
        kept = _run(rank, schedule, x, y, checkpoint="never", dropout=0.3)
        rebuilt = _run(rank, schedule, x, y, checkpoint="always", recompute="bubbles", dropout=0.3)
        out[schedule, "dropout gap"] = _gap(rebuilt, kept)
    # A batch of fewer micro-batches than chunks (one row each: no batch norm): its schedule
    # is rebuilt, its R placed again.
    short = {"checkpoint": "always", "norm": False, "dropout": 0.3}
    rebuilt = _run(rank, "1f1b", x[:3], y[:3], recompute="bubbles", **short)
    out["short gap"] = _gap(rebuilt, _run(rank, "1f1b", x[:3], y[:3], **short))
    return out


def test_recompute_in_the_bubbles_across_ranks_gives_the_plain_models_numbers() -> None:
    results = spawn(2, _body)
    for out in results.values():
        for schedule in LAYOUTS:
            assert out[schedule, "listed"] > 0
            assert out[schedule, "plain gap"] < 1e-5, (schedule, out)
            assert out[schedule, "dropout gap"] == 0.0, (schedule, out)
        assert out["short gap"] == 0.0


def _program(rank: int) -> str:
    import pipepar.distributed as ppd

    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    try:
        ppd.wrap(TwoLayers(), split=["b"], chunks=2, checkpoint="always", recompute="bubbles")
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_model_cut_while_it_runs_refuses_it_on_every_rank() -> None:
    for message in spawn(2, _program).values():
        assert "a model cut while it runs across ranks does not run yet" in message
