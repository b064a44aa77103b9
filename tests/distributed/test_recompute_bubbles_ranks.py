"""``recompute="bubbles"`` across ranks: every rank runs the same schedule with R actions, and
the results are the plain model's (batch norm) and bit-for-bit a pipe's that keeps every graph
(dropout); a model cut while it runs (GPT-2) too."""

from __future__ import annotations

import copy
import threading
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


GPT2_SPLITS = {"1f1b": ["transformer.h.2"], "zb-v": [f"transformer.h.{k}" for k in (1, 2, 3)]}


def _gpt2_step(rank: int, schedule: str, dropout: float, **kw: Any) -> dict[str, Any]:
    """One step of transformers' GPT-2 over the two ranks, cut while it runs."""
    import pipepar.distributed as ppd
    from models import transformers_zoo as zoo
    from pipepar.program.step import SegmentStep

    torch.manual_seed(0)
    model = zoo.gpt2(dropout=dropout)
    pipe = ppd.wrap(
        model, split=GPT2_SPLITS[schedule], chunks=4, schedule=schedule, checkpoint="always",
        **kw,
    )  # fmt: skip
    listed = sum(a.kind == "R" for a in pipe.schedule.worker(rank))
    in_r = threading.local()
    rebuild, calls = SegmentStep.rebuild, [0]

    def marked(step: SegmentStep, i: int) -> None:
        in_r.on = True
        try:
            rebuild(step, i)
        finally:
            in_r.on = False

    def count(*args: object) -> None:
        calls[0] += getattr(in_r, "on", False)

    model.transformer.h[3].attn.register_forward_hook(count)
    SegmentStep.rebuild = marked  # type: ignore[method-assign]
    torch.manual_seed(7)
    ids = torch.randint(1, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    try:
        loss = pipe.step(input_ids=ids, labels=ids)
    finally:
        SegmentStep.rebuild = rebuild  # type: ignore[method-assign]
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return {"loss": torch.as_tensor(loss), "grads": grads, "stats": {}, "listed": listed,
            "in R": calls[0]}  # fmt: skip


def _gpt2_plain() -> dict[str, Any]:
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    model = zoo.gpt2()
    ids = torch.randint(1, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "stats": {}}


def _program(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = _gpt2_plain()
    for schedule in GPT2_SPLITS:
        bubbles = _gpt2_step(rank, schedule, 0.0, recompute="bubbles")
        out[schedule, "listed"] = bubbles["listed"]
        out[schedule, "in R"] = bubbles["in R"]
        out[schedule, "plain gap"] = _gap(bubbles, plain)
        in_place = _gpt2_step(rank, schedule, 0.2)
        rebuilt = _gpt2_step(rank, schedule, 0.2, recompute="bubbles")
        out[schedule, "dropout gap"] = _gap(rebuilt, in_place)
    return out


def test_a_model_cut_while_it_runs_recomputes_in_the_bubbles_across_ranks() -> None:
    """GPT-2 over two ranks: its units run again in R (block 3, on one rank, once per
    micro-batch), with the plain model's numbers, and with dropout those of the pipe
    recomputing inside B, bit for bit."""
    ranks = spawn(2, _program)
    for schedule in GPT2_SPLITS:
        assert sum(out[schedule, "in R"] for out in ranks.values()) == 4
    for out in ranks.values():
        for schedule in GPT2_SPLITS:
            assert out[schedule, "listed"] > 0
            assert out[schedule, "plain gap"] < 1e-5, (schedule, out)
            assert out[schedule, "dropout gap"] == 0.0, (schedule, out)
