"""pipepar.distributed with dp_shard=True (pipepar.ranks.sharding): pp=2 x 2 shards on 4 gloo
ranks, compared with one plain process; memory per rank counted from the local shards;
checkpoints and state dicts round-trip.

One pool of 4 spawned ranks (tests/distributed/test_distributed.py's) runs every case.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import CHUNKS, ROWS, WIDTH, Pool, batches
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import pipepar
import pipepar.distributed as ppd
from pipepar.ranks.sharding import _local_rows, _pad_into, check_dp_shard
from tests.distributed._sharded import Count, local, relative

REL = 1e-5
STEPS = 3
GRIDS = [  # (balance, schedule, checkpoint): pp=2 positions, each sharded over 2 ranks
    ([3, 5], "1f1b", "except_last"),
    ([3, 5], "gpipe", "always"),
    ([2, 2, 2, 2], "zb-v", "never"),  # two virtual stages per rank, weight gradients split off
]


def odd_model(seed: int = 1) -> nn.Sequential:
    """8 layers whose weights shard unevenly over 2 ranks (5, 7 and 1 rows: one shard empty)."""
    torch.manual_seed(seed)
    sizes = [WIDTH, 5, 7, 1, WIDTH]
    layers = [[nn.Linear(a, b), nn.Tanh()] for a, b in itertools.pairwise(sizes)]
    return nn.Sequential(*[m for pair in layers for m in pair])


# -- cases (run on every rank) ------------------------------------------------------------------
def case_matches_plain(rank: int, balance: list[int], schedule: str, checkpoint: str) -> dict:
    """STEPS AdamW steps with clipping on pp=2 x 2 shards and on the plain model (whole batch);
    then an evaluation step and a forward."""
    grid = {"schedule": schedule, "checkpoint": checkpoint, "dp": 2, "dp_shard": True}
    pipe, plain = ppd.wrap(odd_model(), balance, chunks=CHUNKS, **grid), odd_model()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, plain)]
    out: dict[str, Any] = {"losses": [], "norms": [], "gathers": [], "scatters": []}
    for x, y in batches(2, STEPS):
        with Count("all_gather_single") as gathered, Count("reduce_scatter_single") as scattered:
            loss = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        out["gathers"].append(gathered.calls)
        out["scatters"].append(scattered.calls)
        ref = nn.functional.mse_loss(plain(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH))
        ref.backward()
        norm = nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        out["norms"].append((pipe.clip_grad_norm_(0.05).item(), norm.item()))
        out["losses"].append((loss, ref.item()))
        for opt in opts:
            opt.step(), opt.zero_grad()
    full = pipe.full_state_dict()
    out["param_error"] = max(relative(full[k], v) for k, v in plain.state_dict().items())
    out["full_keys"] = list(full)
    with torch.no_grad():  # evaluation and forward gather the shards too
        x, y = batches(2, 1)[0]
        evaluated = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        expected = nn.functional.mse_loss(plain(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH))
        out["losses"].append((evaluated, expected.item()))
        y_pipe, y_plain = pipe(x[pipe.dp_rank]), plain(x[pipe.dp_rank])
        out["forward_error"] = None if y_pipe is None else relative(y_pipe, y_plain)
    params = list(pipe.parameters())
    out["all_dtensors"] = all(isinstance(p, DTensor) for p in params)
    out["state_is_sharded"] = all(
        isinstance(v, DTensor) and v.to_local().shape == p.to_local().shape
        for p in params
        for k, v in opts[0].state[p].items()
        if k != "step"
    )
    pipe.close()
    return out


def held_bytes(pipe: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards), and
    of the storages behind them (each once: a buffer a shard is a view of counts whole)."""
    params = list(pipe.parameters())
    held = {
        "params": [local(p) for p in params],
        "grads": [local(p.grad) for p in params if p.grad is not None],
        "optimizer": [
            local(v) for p in params for v in opt.state[p].values() if isinstance(v, Tensor)
        ],
    }
    sizes = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in held.items()}
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for ts in held.values() for t in ts
    }
    return {**sizes, "storage": sum(s.nbytes() for s in storages.values())}


def _wide_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])


def case_memory(rank: int) -> dict:
    """Bytes held after an AdamW step, replicated (dp=2) and sharded (dp=2, dp_shard); and
    whether two steps without ``zero_grad`` accumulate into the shards as into whole tensors."""
    x = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(rank // 2))
    held: dict[str, Any] = {}
    for sharded in (False, True):
        pipe = ppd.wrap(_wide_model(), [4, 4], chunks=CHUNKS, dp=2, dp_shard=sharded)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        pipe.step(x, x, nn.functional.mse_loss)
        once = [local(p.grad).clone() for p in pipe.parameters()]
        pipe.step(x, x, nn.functional.mse_loss)  # no zero_grad: adds up
        twice = [local(p.grad) for p in pipe.parameters()]
        held["accumulated" if sharded else "accumulated_replicated"] = max(
            (b - 2 * a).abs().max().item() for a, b in zip(once, twice)
        )
        opt.step()
        held["sharded" if sharded else "replicated"] = held_bytes(pipe, opt)
        pipe.close()
    return held


def _sharded_pipe(seed: int = 1, **options: Any) -> tuple[Any, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = odd_model()
    grid = {"dp": 2, "dp_shard": True, **options}
    state = odd_model(seed).state_dict() if seed else None
    pipe = ppd.wrap(model, [3, 5], chunks=CHUNKS, schedule="1f1b", state_dict=state, **grid)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01)


def _train(pipe: Any, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()


def case_checkpoints(rank: int, folder: str) -> dict:
    """Train 2 steps, save (a DCP directory and one file), 2 more; a new sharded pipe and a
    replicated one load the directory and take the same 2 steps; state dicts round-trip."""
    data, path, file = batches(2, 4), os.path.join(folder, "ckpt"), os.path.join(folder, "c.pt")
    pipe, opt = _sharded_pipe()
    _train(pipe, opt, data[:2])
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
    ppd.save_checkpoint(file, pipe, opt)
    at_save, files = pipe.full_state_dict(), sorted(os.listdir(path))
    _train(pipe, opt, data[2:])
    straight = pipe.full_state_dict()
    shifted = {k: v + 1 for k, v in straight.items()}
    pipe.load_state_dict(shifted)
    reloaded = pipe.full_state_dict()
    pipe.close()
    resumed = {}
    for name, options in {"sharded": {}, "replicated": {"dp_shard": False}}.items():
        torch.manual_seed(100 + rank)
        other, other_opt = _sharded_pipe(seed=0, **options)  # other weights until loaded
        extra = ppd.load_checkpoint(path, other, other_opt)
        _train(other, other_opt, data[2:])
        resumed[name] = (other.full_state_dict(), extra)
        other.close()
    return {
        "at_save": at_save,
        "straight": straight,
        "resumed": resumed,
        "reload_error": max((reloaded[k] - v).abs().max().item() for k, v in shifted.items()),
        "files": files,
    }


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("balance", "schedule", "checkpoint"), GRIDS)
def test_sharded_training_matches_one_plain_process(
    pool: Pool, balance: list[int], schedule: str, checkpoint: str
) -> None:
    results = pool.run(case_matches_plain, balance, schedule, checkpoint)
    assert sum(r["forward_error"] is not None for r in results) == 2  # the last stage's ranks
    for r in results:
        assert r["param_error"] < REL, r
        assert all(abs(a - b) <= REL * abs(b) for a, b in r["losses"]), r["losses"]
        # the whole model's norm on every rank (clipped: it is above 0.05)
        assert all(abs(a - b) <= REL * b and b > 0.05 for a, b in r["norms"]), r["norms"]
        assert r["all_dtensors"] and r["state_is_sharded"], r
        assert r["full_keys"] == list(odd_model().state_dict())
        assert r["forward_error"] is None or r["forward_error"] < REL, r
        # weights gathered once per step (every micro-batch), gradients scattered once per
        # bucket: one bucket holds all of a rank's gradients here
        assert r["gathers"] == [1] * STEPS, r["gathers"]
        assert r["scatters"] == [1] * STEPS, r["scatters"]


def _planned_resident(stage: int) -> int:
    """What the planner says a rank of the stage keeps between steps, sharded over 2."""
    from dataclasses import replace

    from pipepar.planner.sharded_state import resident_bytes

    prof = pipepar.profile(_wide_model(), torch.randn(ROWS, 64), optimizer="adamw")
    mine = slice(4 * stage, 4 * stage + 4)
    return resident_bytes(replace(prof, layers=prof.layers[mine], trained=prof.trained[mine]), 2)


@pytest.mark.slow
def test_sharding_halves_the_bytes_each_rank_holds(pool: Pool) -> None:
    for rank, held in enumerate(pool.run(case_memory)):
        assert held["accumulated"] < 1e-6 and held["accumulated_replicated"] < 1e-6, held
        whole, shards = held["replicated"], held["sharded"]
        assert shards["grads"] * 2 == whole["grads"], held
        assert shards["params"] * 2 == whole["params"], held
        total = {
            k: held[k]["params"] + held[k]["grads"] + held[k]["optimizer"]
            for k in ("replicated", "sharded")
        }
        assert abs(total["sharded"] * 2 / total["replicated"] - 1) < 0.05, (rank, held)
        planned = _planned_resident(stage=rank % 2)
        assert abs(total["sharded"] / planned - 1) < 0.05, (rank, total, planned)
        # nothing larger hides behind the shards (a gathered buffer they would be views of)
        assert abs(shards["storage"] * 2 / whole["storage"] - 1) < 0.05, (rank, held)


@pytest.mark.slow
def test_checkpoints_of_shards_resume_and_load_into_a_replicated_pipe(
    pool: Pool, tmp_path: Path
) -> None:
    results = pool.run(case_checkpoints, str(tmp_path))
    assert results[0]["files"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    for rank, r in enumerate(results):
        assert r["reload_error"] == 0.0, rank
        for name, (resumed, extra) in r["resumed"].items():
            assert extra == {"step": 2}, name
            worst = max(relative(v, r["straight"][k]) for k, v in resumed.items())
            assert worst < REL, (rank, name, worst)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    assert saved["model"].keys() == results[0]["at_save"].keys()
    assert all(torch.equal(v, results[0]["at_save"][k]) for k, v in saved["model"].items())
    plain = odd_model(seed=5)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    ppd.load_checkpoint(tmp_path / "c.pt", plain, opt)  # whole optimizer state, by name
    assert {len(s) for s in opt.state.values()} == {3}


# -- no process group ---------------------------------------------------------------------------
def test_dp_shard_is_checked_before_any_communication() -> None:
    with pytest.raises(TypeError, match="dp_shard must be True or False"):
        check_dp_shard("yes", 2)
    with pytest.raises(ValueError, match="dp=1; pass dp=2 or more"):
        check_dp_shard(True, 1)


@pytest.mark.parametrize("shape", [(5, 3), (1, 7), (7,), (2, 2)])
@pytest.mark.parametrize("chunks", [2, 4])
def test_gradients_are_laid_out_as_fsdp_shards_them(shape: tuple[int, ...], chunks: int) -> None:
    g = torch.randn(shape)
    rows = -(-shape[0] // chunks)
    width = rows * (g[0].numel() if g.dim() > 1 else 1)
    send = torch.full((chunks, width), float("nan"))
    _pad_into(send, g, chunks)
    pieces: list[Tensor] = list(torch.chunk(g, chunks))
    pieces += [g[:0]] * (chunks - len(pieces))  # torch.chunk may give fewer: empty shards
    for j, piece in enumerate(pieces):
        n = _local_rows(shape[0], rows, j)
        assert n == piece.shape[0]
        got = send[j].view(rows, *shape[1:])
        assert torch.equal(got[:n], piece) and bool(got[n:].isnan().all())  # padding left
