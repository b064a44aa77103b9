"""Sharded training checkpoints (``ppd.save_checkpoint`` to a directory, through
``torch.distributed.checkpoint``): resuming is bit-identical, a checkpoint loads into any
layout, into a one-process pipe and into the plain model (``pipepar convert``), and a save that
dies half-way leaves the previous checkpoint as it was.

Multi-process cases (``slow``) run on the 4-rank gloo pool of
``tests/distributed/test_distributed.py``: pp=2 x dp=2 over the 4 ranks, or two pipelines of
pp=2 (ranks 0-1 and 2-3, one stage per rank or two under zb-v), each with its own checkpoint.
Ranks use one math thread, so pipes of any balance compute the same bits.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import pipepar
import pipepar.distributed as ppd
from pipepar.cli.main import main as cli
from pipepar.persist import sharded
from pipepar.persist.named_state import named_optimizer_state
from tests.distributed.test_distributed import (
    BALANCE,
    CHUNKS,
    ROWS,
    TOL,
    WIDTH,
    Pool,
    _subgroup,
    batches,
    tiny_model,
)

GRID = {"balance": BALANCE[2], "dp": 2}  # 2 stages x 2 replicas on the 4 ranks
GPT2_SPLIT = ["transformer.h.2"]


def _ready(rank: int) -> int:
    return rank


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool()
    p.run(_ready)  # the ranks' start-up counts as setup, not in the first test
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _one_math_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- nn.Sequential on pp=2 x dp=2 ---------------------------------------------------------------
def _train(pipe: Any, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()


def _sequential(state_dict: dict | None = None, **grid: Any) -> tuple[Any, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = tiny_model()
    pipe = ppd.wrap(model, **(grid or GRID), chunks=CHUNKS, schedule="1f1b", state_dict=state_dict)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01)


def case_sequential(rank: int, folder: str) -> dict:
    """2 steps, save, 2 more steps (the run straight through) vs a new pipe (other init) that
    loads the checkpoint and takes the 2 steps; then the checkpoint into pp=4 and into two
    pipelines of pp=2 (other balance)."""
    data, path = batches(2, 4), os.path.join(folder, "seq")
    pipe, opt = _sequential(tiny_model().state_dict())
    _train(pipe, opt, data[:2])
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
    at_save, files = pipe.full_state_dict(), sorted(os.listdir(path))
    _train(pipe, opt, data[2:])
    straight = pipe.full_state_dict()
    pipe.close()
    torch.manual_seed(100 + rank)
    pipe, opt = _sequential()  # reset_parameters: other weights until the checkpoint is loaded
    extra = ppd.load_checkpoint(path, pipe, opt)
    _train(pipe, opt, data[2:])
    resumed = pipe.full_state_dict()
    pipe.close()
    loaded = {}
    for name, grid in {
        "pp4": {"balance": BALANCE[4], "dp": 1},
        "pp2-other-balance": {"balance": [5, 3], "dp": 1, "group": _subgroup(2)},
    }.items():
        pipe, opt = _sequential(**grid)
        ppd.load_checkpoint(path, pipe, opt)
        loaded[name] = (pipe.full_state_dict(), named_optimizer_state(pipe, opt))
        pipe.close()
    return {
        "straight": straight,
        "at_save": at_save,
        "resumed": resumed,
        "extra": extra,
        "files": files,
        "loaded": loaded,
    }


@pytest.mark.slow
def test_sequential_resumes_bit_for_bit_and_loads_into_other_layouts(
    pool: Pool, tmp_path: Path
) -> None:
    results = pool.run(case_sequential, str(tmp_path))
    # replica 0's two ranks wrote in parallel, the other replica nothing
    assert results[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for rank, r in enumerate(results):
        assert r["resumed"].keys() == r["straight"].keys()
        differ = [k for k, v in r["resumed"].items() if not torch.equal(v, r["straight"][k])]
        assert not differ, f"rank {rank}: resumed run differs in {differ}"
        assert r["extra"] == {"step": 2}
        for name, (weights, _) in r["loaded"].items():
            assert all(torch.equal(weights[k], v) for k, v in r["at_save"].items()), name
    # the optimizer state came back whole, under the names of the parameters
    convert = tmp_path / "seq.pt"
    assert cli(["convert", str(tmp_path / "seq"), str(convert)]) == 0
    saved = torch.load(convert, weights_only=True)
    assert saved["format"] == "pipepar/1" and saved["balance"] == BALANCE[2] and saved["dp"] == 2
    assert list(saved["model"]) == list(results[0]["at_save"])  # the model's order
    loaded = [r["loaded"][layout][1]["state"] for r in results for layout in r["loaded"]]
    assert {name for state in loaded for name in state} == saved["optimizer"]["state"].keys()
    for state in loaded:
        _same_optimizer_state(state, saved["optimizer"]["state"])
    _plain_resumes_from(convert, results[0]["at_save"], results[0]["straight"])


def _same_optimizer_state(got: dict, saved: dict) -> None:
    for name, entry in got.items():
        assert entry.keys() == saved[name].keys(), name
        assert all(torch.equal(v, saved[name][k]) for k, v in entry.items()), name


def _plain_resumes_from(path: Path, at_save: dict, straight: dict) -> None:
    """The converted file resumes the plain model and a one-process pipe (whole batches)."""
    for module in (
        tiny_model(seed=7),
        pipepar.wrap(tiny_model(seed=7), [4, 4], devices=["cpu", "cpu"], chunks=CHUNKS),
    ):
        opt = torch.optim.Adam(module.parameters(), lr=0.01)
        assert ppd.load_checkpoint(path, module, opt) == {"step": 2}
        assert all(torch.equal(v, at_save[k]) for k, v in module.state_dict().items())
        for x, y in batches(2, 4)[2:]:
            nn.functional.mse_loss(module(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH)).backward()
            opt.step()
            opt.zero_grad()
        worst = max((v - straight[k]).abs().max().item() for k, v in module.state_dict().items())
        assert worst < TOL, (type(module).__name__, worst)
        if isinstance(module, pipepar.Pipe):
            module.close()


# -- a failed save ------------------------------------------------------------------------------
def case_failed_save(rank: int, folder: str) -> dict:
    """Rank 1 cannot write its part: every rank raises, the checkpoint there is untouched, no
    staging directory is left and the pipe goes on."""
    path = os.path.join(folder, "seq")
    pipe, opt = _sequential(tiny_model().state_dict())
    _train(pipe, opt, batches(2, 1))
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 1})
    before = pipe.full_state_dict()
    _train(pipe, opt, batches(2, 1))
    real = dcp.FileSystemWriter.write_data

    def no_space(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device")

    if rank == 1:
        dcp.FileSystemWriter.write_data = no_space  # type: ignore[method-assign]
    try:
        ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
        raised = "nothing"
    except (OSError, RuntimeError) as e:  # a RuntimeError: a report of another rank's error
        raised = f"{'OSError' if isinstance(e, OSError) else 'RuntimeError'}: {e}"
    finally:
        dcp.FileSystemWriter.write_data = real  # type: ignore[method-assign]
    x, y = batches(2, 1)[0]
    loss = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
    dist.barrier()
    fresh, opt = _sequential()
    extra = ppd.load_checkpoint(path, fresh, opt)
    after = fresh.full_state_dict()
    pipe.close()
    fresh.close()
    return {
        "raised": raised,
        "loss": loss,
        "files": sorted(os.listdir(folder)),
        "extra": extra,
        "intact": all(torch.equal(after[k], v) for k, v in before.items()),
    }


@pytest.mark.slow
def test_a_failed_save_leaves_the_previous_checkpoint(pool: Pool, tmp_path: Path) -> None:
    results = pool.run(case_failed_save, str(tmp_path))
    for rank, r in enumerate(results):
        if rank == 1:  # the rank that failed gets its own error, the others a report of it
            assert r["raised"] == "OSError: [Errno 28] No space left on device", r["raised"]
        else:
            assert r["raised"].startswith(f"RuntimeError: checkpoint {tmp_path / 'seq'} was not")
            assert "rank 1 could not write it: OSError: [Errno 28]" in r["raised"], r["raised"]
        assert r["files"] == ["seq"]  # the staging directory was removed
        assert r["extra"] == {"step": 1} and r["intact"]
        assert r["loss"] > 0


# -- GPT-2 (tied head) on two pipelines of 2 ranks, then on pp=2 x dp=2 -------------------------
def _gpt2(seed: int, **options: Any) -> tuple[Any, torch.optim.Optimizer]:
    from models import transformers_zoo as zoo

    torch.manual_seed(seed)
    options = {"split": GPT2_SPLIT, "group": _subgroup(2), "schedule": "1f1b", **options}
    pipe = ppd.wrap(zoo.gpt2(), chunks=2, **options)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-3)


def _gpt2_steps(pipe: Any, opt: torch.optim.Optimizer, steps: range) -> None:
    from models import transformers_zoo as zoo

    for step in steps:
        pipe.step(**zoo.sample("gpt2", batch=4, seed=step))
        opt.step()
        opt.zero_grad()


def _state(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def case_gpt2(rank: int, folder: str) -> dict:
    """Per pipeline of 2 ranks: 2 steps, save, 2 more steps vs a new pipe (other init) that
    loads the checkpoint and takes the 2 steps; the checkpoint into another split; then
    pipeline 0's one-file checkpoint on all 4 ranks as pp=2 x dp=2."""
    path = os.path.join(folder, f"gpt2-{rank // 2}")
    pipe, opt = _gpt2(0)
    _gpt2_steps(pipe, opt, range(2))
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
    ppd.save_checkpoint(f"{path}.pt", pipe, opt, extra={"step": 2})  # one file too
    _gpt2_steps(pipe, opt, range(2, 4))
    straight = _state(pipe)
    pipe.close()
    pipe, opt = _gpt2(100 + rank)
    extra = ppd.load_checkpoint(path, pipe, opt)
    _gpt2_steps(pipe, opt, range(2, 4))
    resumed = _state(pipe)
    pipe.close()
    pipe, opt = _gpt2(5, split=["transformer.h.1"])
    ppd.load_checkpoint(path, pipe, opt)
    other_split = (_state(pipe), named_optimizer_state(pipe, opt))
    pipe.close()
    pipe, opt = _gpt2(6, split=GPT2_SPLIT, dp=2, group=None)
    ppd.load_checkpoint(os.path.join(folder, "gpt2-0.pt"), pipe, opt)
    grid = _state(pipe)
    _gpt2_steps(pipe, opt, range(2, 3))  # the replicas train on from it
    pipe.close()
    return {
        "straight": straight,
        "resumed": resumed,
        "extra": extra,
        "other_split": other_split,
        "grid": grid,
    }


@pytest.mark.slow
def test_gpt2_resumes_bit_for_bit_and_loads_anywhere(pool: Pool, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from models import transformers_zoo as zoo

    results = pool.run(case_gpt2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["resumed"].keys() == r["straight"].keys()
        differ = [k for k, v in r["resumed"].items() if not torch.equal(v, r["straight"][k])]
        assert not differ, f"rank {rank}: resumed run differs in {differ}"
        assert r["extra"] == {"step": 2}
    # the tied weight is saved once, under its first name
    keys = dcp.FileSystemReader(tmp_path / "gpt2-0").read_metadata().state_dict_metadata
    assert "model.transformer.wte.weight" in keys and "model.lm_head.weight" not in keys
    out = tmp_path / "gpt2.pt"
    sharded.to_single_file(tmp_path / "gpt2-0", out, fsync=False)
    saved = torch.load(out, weights_only=True)
    assert saved["model"]["lm_head.weight"] is saved["model"]["transformer.wte.weight"]
    one_file = torch.load(tmp_path / "gpt2-0.pt", weights_only=True)  # gathered, same content
    assert one_file["model"].keys() == saved["model"].keys()
    assert all(torch.equal(v, saved["model"][k]) for k, v in one_file["model"].items())
    assert one_file["balance"] == saved["balance"] == [5, 4]  # units per stage
    for rank, r in enumerate(results):
        weights, optimizer = r["other_split"]
        for k, v in [*weights.items(), *r["grid"].items()]:
            assert torch.equal(v, saved["model"][k]), (rank, k)
        _same_optimizer_state(optimizer["state"], saved["optimizer"]["state"])
    # the plain model resumes from the converted file
    plain = zoo.gpt2()
    opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    assert ppd.load_checkpoint(out, plain, opt) == {"step": 2}
    for step in range(2, 4):
        plain(**zoo.sample("gpt2", batch=4, seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    straight = {**results[0]["straight"], **results[1]["straight"]}
    for k, v in plain.state_dict().items():
        assert torch.allclose(v, straight[k], rtol=1e-4, atol=1e-6), k


def case_gpt2_virtual(rank: int, folder: str) -> dict:
    """zb-v: each of the 2 ranks of a pipeline computes 2 of the 4 stages (0 and 3 hold the
    tied embedding and head); 2 steps, save, 2 more vs a new pipe that loads and takes them."""
    path = os.path.join(folder, f"zbv-{rank // 2}")
    split = ["transformer.h.0", "transformer.h.2", "transformer.h.3"]
    pipe, opt = _gpt2(0, split=split, schedule="zb-v")
    _gpt2_steps(pipe, opt, range(2))
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
    _gpt2_steps(pipe, opt, range(2, 4))
    straight, stages = _state(pipe), pipe.stages
    pipe.close()
    pipe, opt = _gpt2(50 + rank, split=split, schedule="zb-v")
    ppd.load_checkpoint(path, pipe, opt)
    _gpt2_steps(pipe, opt, range(2, 4))
    resumed = _state(pipe)
    pipe.close()
    return {"stages": stages, "straight": straight, "resumed": resumed}


@pytest.mark.slow
def test_gpt2_on_virtual_stages_resumes_bit_for_bit(pool: Pool, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from models import transformers_zoo as zoo

    results = pool.run(case_gpt2_virtual, str(tmp_path))
    assert [r["stages"] for r in results] == [[0, 3], [1, 2], [0, 3], [1, 2]]
    for rank, r in enumerate(results):
        differ = [k for k, v in r["resumed"].items() if not torch.equal(v, r["straight"][k])]
        assert not differ, f"rank {rank}: resumed run differs in {differ}"
    keys = dcp.FileSystemReader(tmp_path / "zbv-0").read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert saved == set(zoo.gpt2().state_dict()) - {"lm_head.weight"}  # each tensor once


# -- one process: the plain model ---------------------------------------------------------------
def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    fast = [p for n, p in model.named_parameters() if n.startswith("3.")]
    slow = [p for n, p in model.named_parameters() if not n.startswith("3.")]
    return torch.optim.Adam([{"params": slow}, {"params": fast, "lr": 0.05}], lr=0.01)


@pytest.mark.parametrize("into", ["plain", "pipe"])
def test_the_plain_model_resumes_bit_for_bit(tmp_path: Path, into: str) -> None:
    straight = _model()
    opt = _adam(straight)
    _steps(straight, opt, range(4))
    model = _model()
    opt = _adam(model)
    _steps(model, opt, range(2))
    ppd.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 2, "data": [1, 2]})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    fresh = _model(seed=9)
    if into == "pipe":  # one micro-batch: the pipe computes what the plain model computes
        fresh = pipepar.wrap(fresh, [2, 2], devices=["cpu", "cpu"], chunks=1)
    opt = _adam(fresh)
    assert ppd.load_checkpoint(tmp_path / "ckpt", fresh, opt) == {"step": 2, "data": [1, 2]}
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.05]
    _steps(fresh, opt, range(2, 4))
    for k, v in straight.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    if isinstance(fresh, pipepar.Pipe):
        fresh.close()


def test_a_save_that_died_half_way_is_ignored_and_cleared(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "ckpt"
    ppd.save_checkpoint(path, model, extra={"step": 1})
    # a process killed while writing the next one: a staging directory without metadata
    (tmp_path / ".ckpt.tmp").mkdir()
    (tmp_path / ".ckpt.tmp" / "__0_0.distcp").write_bytes(b"half a file")
    fresh = _model(seed=3)
    assert ppd.load_checkpoint(path, fresh) == {"step": 1}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    ppd.save_checkpoint(path, fresh, extra={"step": 2})  # clears it
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # killed between its two renames: the previous checkpoint, complete under another name,
    # is what a load reads (a resuming job must not start afresh)
    os.replace(path, tmp_path / ".ckpt.old")
    assert ppd.load_checkpoint(path, _model(seed=4)) == {"step": 2}
    shutil.rmtree(tmp_path / ".ckpt.old")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at"):
        ppd.load_checkpoint(path, fresh)
    # a write that fails leaves the checkpoint and nothing else
    ppd.save_checkpoint(path, fresh, extra={"step": 3})
    real = dcp.FileSystemWriter.write_data
    dcp.FileSystemWriter.write_data = _no_space  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="No space left"):
            ppd.save_checkpoint(path, fresh, extra={"step": 4})
    finally:
        dcp.FileSystemWriter.write_data = real  # type: ignore[method-assign]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert ppd.load_checkpoint(path, fresh) == {"step": 3}


def _no_space(self: Any, plan: Any, planner: Any) -> Any:
    raise OSError(28, "No space left on device")


def test_convert_writes_one_file_the_plain_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model()
    opt = _adam(model)
    _steps(model, opt, range(2))
    ppd.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 2})
    assert cli(["convert", str(tmp_path / "ckpt"), str(tmp_path / "one.pt")]) == 0
    assert "one.pt" in capsys.readouterr().out
    saved = torch.load(tmp_path / "one.pt", weights_only=True)
    plain = _model(seed=4)
    plain.load_state_dict(saved["model"])  # strict: every key of the plain model
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    assert [g["params"] for g in saved["optimizer"]["param_groups"]] == [
        ["0.weight", "0.bias", "1.weight", "1.bias"],
        ["3.weight", "3.bias"],
    ]
    assert saved["extra"] == {"step": 2}
    assert cli(["convert", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    assert "no checkpoint directory at" in capsys.readouterr().err


def test_loading_refuses_what_does_not_fit(tmp_path: Path) -> None:
    model = _model()
    ppd.save_checkpoint(tmp_path / "ckpt", model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        ppd.load_checkpoint(tmp_path / "ckpt", model, opt)
    wider = nn.Sequential(nn.Linear(6, 9), nn.BatchNorm1d(9), nn.Tanh(), nn.Linear(9, 3))
    with pytest.raises(ValueError, match=r"0\.weight is \(8, 6\) in .* but \(9, 6\) here"):
        ppd.load_checkpoint(tmp_path / "ckpt", wider)
    renamed = nn.Sequential(nn.Sequential(*_model()))
    with pytest.raises(ValueError, match=r"has no entry for '0\.0\.weight'"):
        ppd.load_checkpoint(tmp_path / "ckpt", renamed)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no checkpoint metadata"):
        ppd.load_checkpoint(tmp_path / "empty", model)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        ppd.save_checkpoint(tmp_path / "file", model, sharded=True)
    with pytest.raises(TypeError, match="sharded must be True, False or None"):
        ppd.save_checkpoint(tmp_path / "ckpt", model, sharded="yes")  # type: ignore[arg-type]


def test_the_path_chooses_the_format(tmp_path: Path) -> None:
    model = _model()
    ppd.save_checkpoint(tmp_path / "a.pt", model)
    ppd.save_checkpoint(tmp_path / "b", model)
    ppd.save_checkpoint(tmp_path / "c.pt", model, sharded=True)
    assert (tmp_path / "a.pt").is_file() and (tmp_path / "b").is_dir()
    assert (tmp_path / "c.pt").is_dir()
    assert torch.load(tmp_path / "a.pt", weights_only=True)["format"] == "pipepar/1"
    for name in ("a.pt", "b", "c.pt"):
        assert ppd.load_checkpoint(tmp_path / name, _model(seed=2)) == {}
