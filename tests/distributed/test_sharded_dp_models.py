"""pipepar.distributed with dp_shard=True for any model (pipepar.program.rank_compute): pp=2 x 2
shards on 4 gloo ranks for transformers' GPT-2 (tied embedding and head, on different ranks)
and Llama, compared with one plain process on the global batch; bytes per rank counted from
the local shards; a checkpoint directory round-trips.

One pool of 4 spawned ranks (tests/distributed/test_distributed.py's) runs every case.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import Pool
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import pipepar.distributed as ppd
from models import transformers_zoo as zoo
from tests.distributed._sharded import Count, local, relative

REL = 1e-5
STEPS = 3
MAX_NORM = 0.5
SPLITS = {  # two stages, and four for the virtual-stage schedules
    2: {"gpt2": ["transformer.h.2"], "llama": ["model.layers.2"]},
    4: {
        "gpt2": ["transformer.h.1", "transformer.h.2", "transformer.h.3"],
        "llama": ["model.layers.1", "model.layers.2", "model.layers.3"],
    },
}
GRIDS = [  # (model, schedule, stages): pp=2 positions, each sharded over 2 ranks
    ("gpt2", "1f1b", 2),  # the tied embedding on rank 0, the head on rank 1
    ("llama", "1f1b", 2),
    ("gpt2", "interleaved-1f1b", 4),  # two stages per rank, the tie across ranks still
    ("llama", "zb-h1", 2),  # weight gradients split off
    ("gpt2", "gpipe", 2),
    ("llama", "zb-v", 4),  # V placement: stages 0 and 3 on one rank
]


def _models(name: str) -> tuple[nn.Module, nn.Module]:
    """The model to wrap and the plain one, with the same random weights."""
    torch.manual_seed(0)
    model = zoo.build(name)
    torch.manual_seed(0)
    return model, zoo.build(name)


def _batch(name: str, step: int, replica: int | None = None) -> dict[str, Tensor]:
    """The global batch of a step (padded: micro-batches and replicas hold different numbers
    of labels), or one replica's half of it."""
    whole = zoo.padded_sample(name, batch=8, seq=8, seed=step)
    return whole if replica is None else {k: v.chunk(2)[replica] for k, v in whole.items()}


def _wrap(model: nn.Module, name: str, schedule: str, stages: int) -> Any:
    split = SPLITS[stages][name]
    return ppd.wrap(model, split=split, chunks=2, schedule=schedule, dp=2, dp_shard=True)


def _param_error(pipe: Any, plain: nn.Module) -> float:
    """The largest difference of a weight (gathered whole from its shards) from the plain
    model's, relative to the model's largest weight; a collective over the replicas.

    Not relative to each tensor's own largest value: GPT-2's attention key bias has a gradient
    that is zero but for rounding (softmax ignores it), which AdamW turns into steps of
    +-lr in any split of the batch (the replicated pipe's too), large next to that bias.
    """
    ref = dict(plain.named_parameters())
    scale = max(p.detach().abs().max() for p in plain.parameters())
    errors = [(p.full_tensor() - ref[n].detach()).abs().max() for n, p in pipe.named_parameters()]
    return (max(errors) / scale).item()


def _train(pipe: Any, opt: torch.optim.Optimizer, name: str, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pipe.step(**_batch(name, step, pipe.mesh.where.replica)))
        pipe.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses


# -- cases (run on every rank) ------------------------------------------------------------------
def case_matches_plain(rank: int, name: str, schedule: str, stages: int) -> dict[str, Any]:
    """An evaluation forward, then STEPS AdamW steps with clipping on pp=2 x 2 shards and on
    the plain model (whole batch)."""
    model, plain = _models(name)
    pipe = _wrap(model, name, schedule, stages)
    replica = pipe.mesh.where.replica
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (pipe, plain)]
    out: dict[str, Any] = {"losses": [], "norms": [], "gathers": [], "scatters": []}
    with torch.no_grad():  # evaluation gathers the shards too
        got = pipe(**_batch(name, 0, replica))
        expected = plain(**_batch(name, 0, replica))
        out["forward_error"] = None if got is None else relative(got.logits, expected.logits)
    for step in range(STEPS):
        with Count("all_gather_single") as gathered, Count("reduce_scatter_single") as scattered:
            loss = pipe.step(**_batch(name, step, replica))
        out["gathers"].append(gathered.calls)
        out["scatters"].append(scattered.calls)
        ref = plain(**_batch(name, step)).loss
        ref.backward()
        norm = nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
        out["norms"].append((pipe.clip_grad_norm_(MAX_NORM).item(), norm.item()))
        out["losses"].append((loss, ref.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["param_error"] = _param_error(pipe, plain)
    params = list(pipe.parameters())
    out["all_dtensors"] = all(isinstance(p, DTensor) for p in params)
    out["state_is_sharded"] = all(
        isinstance(v, DTensor) and v.to_local().shape == p.to_local().shape
        for p in params
        for k, v in opts[0].state[p].items()
        if k != "step"
    )
    out["bytes"] = {  # the shards this rank keeps, and the weights they are shards of
        "shards": sum(local(p).numel() * p.element_size() for p in params),
        "whole": sum(p.numel() * p.element_size() for p in params),
        "model": sum(  # the model's own parameters hold no storage between steps
            p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta
        ),
    }
    out["keys"] = sorted(pipe.state_dict())
    pipe.close()
    return out


def case_checkpoint(rank: int, folder: str) -> dict[str, Any]:
    """GPT-2 sharded: one step, save a DCP directory and one file, one more step; load the
    directory back into the pipe and its optimizer and take that step again: the same
    weights. Then a whole state_dict loads into the shards."""
    model, plain = _models("gpt2")
    pipe = _wrap(model, "gpt2", "1f1b", 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    path = os.path.join(folder, "ckpt")
    _train(pipe, opt, "gpt2", range(1))
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 1})
    ppd.save_checkpoint(os.path.join(folder, "c.pt"), pipe, opt)
    at_save = {n: p.full_tensor().detach() for n, p in pipe.named_parameters()}
    files = sorted(os.listdir(path))
    straight = _train(pipe, opt, "gpt2", range(1, 2))
    after = {n: p.full_tensor() for n, p in pipe.named_parameters()}
    extra = ppd.load_checkpoint(path, pipe, opt)
    again = _train(pipe, opt, "gpt2", range(1, 2))
    errors = {n: relative(p.full_tensor(), after[n]) for n, p in pipe.named_parameters()}
    shifted = {k: v + 1 for k, v in plain.state_dict().items()}
    pipe.load_state_dict(shifted)
    loaded = max(
        (p.full_tensor() - shifted[n]).abs().max().item() for n, p in pipe.named_parameters()
    )
    pipe.close()
    return {
        "files": files,
        "extra": extra,
        "losses": (straight, again),
        "errors": errors,
        "at_save": at_save,
        "loaded": loaded,
    }


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule", "stages"), GRIDS)
def test_sharded_models_match_one_plain_process(
    pool: Pool, name: str, schedule: str, stages: int
) -> None:
    results = pool.run(case_matches_plain, name, schedule, stages, timeout=240.0)
    assert sum(r["forward_error"] is not None for r in results) == 2  # the last stage's ranks
    for rank, r in enumerate(results):
        assert r["param_error"] < REL, (rank, r["param_error"])
        assert all(abs(a - b) <= REL * abs(b) for a, b in r["losses"]), (rank, r["losses"])
        # the whole model's norm on every rank, clipped (it is above MAX_NORM)
        assert all(abs(a - b) <= REL * b and b > MAX_NORM for a, b in r["norms"]), r["norms"]
        assert r["forward_error"] is None or r["forward_error"] < REL, (rank, r)
        assert r["all_dtensors"] and r["state_is_sharded"], rank
        # gathered once per step for every micro-batch and stage; one bucket of gradients
        assert r["gathers"] == [1] * STEPS, (rank, r["gathers"])
        assert r["scatters"] == [1] * STEPS, (rank, r["scatters"])
        held = r["bytes"]
        assert held["model"] == 0, (rank, held)
        assert abs(held["shards"] * 2 / held["whole"] - 1) < 0.05, (rank, held)
    for position in (0, 1):  # replicas hold the same keys, the model's names
        assert results[position]["keys"] == results[position + 2]["keys"]
    if name == "gpt2":  # the tied weight, held by the ranks of both positions
        assert all("lm_head.weight" in r["keys"] for r in results)


@pytest.mark.slow
def test_checkpoint_of_sharded_model_resumes(pool: Pool, tmp_path: Path) -> None:
    results = pool.run(case_checkpoint, str(tmp_path), timeout=240.0)
    assert results[0]["files"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    for rank, r in enumerate(results):
        assert r["extra"] == {"step": 1}, rank
        straight, again = r["losses"]
        assert abs(straight[0] - again[0]) <= REL * abs(straight[0]), (rank, r["losses"])
        worst = max(r["errors"].values())
        assert worst < REL, (rank, worst, r["errors"])
        assert r["loaded"] == 0.0, rank
    saved = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    assert set(saved) == set(_models("gpt2")[1].state_dict())  # every key, the tied head too
    for rank, r in enumerate(results):  # gathered whole from the shards
        assert all(torch.equal(saved[n], t) for n, t in r["at_save"].items()), rank
