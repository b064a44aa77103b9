"""One pipe class across ranks: an nn.Sequential and any other model are both a
``DistributedPipe`` (a chain compute, a program compute); the same nn.Sequential through either
compute gives the same loss and gradients; ``full_state_dict`` gathers the whole model for any
model, tied weights under each of their names; the chain's ``step``/``forward`` take their
input by position or by the name ``x``."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

from tests._ranks import spawn

pytestmark = pytest.mark.slow


class Tied(nn.Module):
    """An embedding and a head sharing one weight, two blocks between (one per stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd
    from pipepar.distributed.chain import RankChain
    from pipepar.program.rank_compute import RankProgram

    out: dict[str, Any] = {}
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)), torch.arange(8) % 3
    loss_fn = nn.functional.cross_entropy
    for how, kwargs in (("chain", {"balance": [2, 2]}), ("program", {"split": ["2"]})):
        model = _chain()
        pipe = ppd.wrap(model, chunks=4, schedule="1f1b", checkpoint="always", **kwargs)
        out[f"{how}_type"] = (type(pipe).__name__, type(pipe.compute).__name__)
        if how == "chain":  # stage 0 reads x, the last stage the target: by position or name
            loss = pipe.step(x=x if rank == 0 else None, target=y, loss_fn=loss_fn)
        else:
            loss = pipe.step(x, target=y, loss_fn=loss_fn)
        out[f"{how}_loss"] = loss
        out[f"{how}_grads"] = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
        with torch.no_grad():
            output = pipe.eval()(x=x) if how == "chain" else pipe.eval()(x)
        out[f"{how}_eval"] = None if output is None else output.numpy().copy()
        pipe.close()
    kinds = (out["chain_type"][1], out["program_type"][1])
    assert kinds == (RankChain.__name__, RankProgram.__name__)
    torch.manual_seed(0)
    tied = Tied()
    plain = copy.deepcopy(tied.state_dict())
    pipe = ppd.wrap(tied, split=["blocks.1"], chunks=2)
    whole = pipe.full_state_dict()
    out["full_keys"] = list(whole)
    out["plain_keys"] = list(plain)
    out["full_equal"] = all(torch.equal(whole[k], plain[k]) for k in plain)
    pipe.close()
    out["gc"] = _collecting(rank)
    return out


def _collecting(rank: int) -> dict[str, Any]:
    """Two steps with ``gc_every=2``: whether Python's collector was on in the loss (the last
    stage's rank), after each step, and the generations of the passes that ended."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    pipe = ppd.wrap(Tied(), split=["blocks.1"], chunks=2, gc_every=2)
    seen: list[bool] = []
    passes: list[int] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            passes.append(info["generation"])

    ids = torch.arange(8).reshape(2, 4) % 11
    after = []
    gc.callbacks.append(record)
    try:
        for _ in range(2):
            pipe.step(ids, target=ids, loss_fn=loss_fn)
            after.append(gc.isenabled())
    finally:
        gc.callbacks.remove(record)
    pipe.close()
    return {"seen": seen, "after": after, "full": passes.count(2), "young": passes.count(1)}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def test_every_model_is_one_pipe_class_across_ranks(ranks: dict[int, Any]) -> None:
    for rank in (0, 1):
        assert ranks[rank]["chain_type"] == ("DistributedPipe", "RankChain")
        assert ranks[rank]["program_type"] == ("DistributedPipe", "RankProgram")


def test_the_two_computes_agree_across_ranks(ranks: dict[int, Any]) -> None:
    """The same nn.Sequential as a chain (balance) and as a program (split by path), recomputing
    every micro-batch: the same loss on every rank, the same gradients of each rank's layers,
    the same evaluation output on the last stage (None on the first)."""
    for rank in (0, 1):
        r = ranks[rank]
        assert r["chain_loss"] == pytest.approx(r["program_loss"], rel=1e-6)
        assert r["chain_grads"].keys() == r["program_grads"].keys() and r["chain_grads"]
        for name, g in r["chain_grads"].items():
            torch.testing.assert_close(
                torch.from_numpy(g), torch.from_numpy(r["program_grads"][name]), msg=name
            )
    assert ranks[0]["chain_eval"] is None and ranks[0]["program_eval"] is None
    torch.testing.assert_close(
        torch.from_numpy(ranks[1]["chain_eval"]), torch.from_numpy(ranks[1]["program_eval"])
    )


def test_full_state_dict_of_any_model_is_the_plain_models(ranks: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = ranks[rank]
        assert r["full_keys"] == r["plain_keys"]  # the tied head under both of its names
        assert r["full_equal"]


def test_gc_every_turns_the_collector_off_during_steps_on_every_rank(
    ranks: dict[int, Any],
) -> None:
    """``gc_every=2``: off in the loss (the last stage's rank computes it), on after each step,
    a young pass after the first step and a full one after the second, on both ranks."""
    assert ranks[1]["gc"]["seen"]
    assert not any(ranks[0]["gc"]["seen"] + ranks[1]["gc"]["seen"])
    for rank in (0, 1):
        got = ranks[rank]["gc"]
        assert got["after"] == [True, True], rank
        assert got["full"] >= 1 and got["young"] >= 1, (rank, got)
