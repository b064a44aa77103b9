"""The planner knows sharded data parallelism: a rank of a shard group holds, through a step,
the gathered weights and gradient sums plus its shards, and the optimizer state of its shards
only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pipepar
from pipepar.cli.main import main as cli
from pipepar.planner.sharded_state import resident_bytes, shard_shape, sharded


def _mlp() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(8)), nn.Linear(64, 7))


def test_one_rank_holds_shards_of_state_and_the_gathered_step() -> None:
    prof = pipepar.profile(_mlp(), torch.randn(16, 64), optimizer="adam")
    one = sharded(prof, 4)
    assert one.shard == 4 and sharded(prof, 1) is prof
    for layer, whole in zip(one.layers[:-1], prof.layers):  # Linear(64, 64): 16 rows each
        assert layer.params_bytes == whole.params_bytes * 5 // 4
        assert layer.optimizer_bytes == whole.optimizer_bytes // 4
    last = one.layers[-1]  # Linear(64, 7): weight 7 x 64 and bias 7, two rows each of 4 ranks
    assert last.params_bytes == prof.layers[-1].params_bytes + (2 * 64 + 2) * 4
    assert last.grads_bytes == prof.layers[-1].grads_bytes + (2 * 64 + 2) * 4
    assert last.optimizer_bytes == 2 * (2 * 64 + 2) * 4  # Adam: two states per element


def test_resident_state_divides_by_the_group() -> None:
    """Between steps a rank keeps its shards: the replicated state / n, within the padding."""
    prof = pipepar.profile(_mlp(), torch.randn(16, 64), optimizer="adamw")
    whole = prof.total("params_bytes") + prof.total("grads_bytes") + prof.total("optimizer_bytes")
    for n in (2, 4, 8):
        assert whole / n <= resident_bytes(prof, n) <= 1.05 * whole / n


def test_shard_shapes_follow_dimension_zero() -> None:
    assert shard_shape((10, 4), 4) == (3, 4)
    assert shard_shape((1,), 2) == (1,)
    assert shard_shape((), 2) == ()


def test_sharding_lowers_the_planned_peak_by_the_optimizer_state() -> None:
    prof = pipepar.profile(_mlp(), torch.randn(16, 64), optimizer="adam")
    replicated = pipepar.plan(prof, devices=2, chunks=4, schedule="1f1b", checkpoint="never")
    split = pipepar.plan(prof, devices=2, chunks=4, schedule="1f1b", checkpoint="never", shard=4)
    assert split.to_dict()["config"]["shard"] == 4
    assert split.peak_bytes < replicated.peak_bytes
    saved = replicated.totals()["optimizer_bytes"] - split.totals()["optimizer_bytes"]
    assert saved > 0.7 * replicated.totals()["optimizer_bytes"]
    assert "sharded over 4 ranks" in pipepar.report.table(split)
    with pytest.raises(ValueError, match=r"shard=0 must be an int >= 1"):
        pipepar.plan(prof, devices=2, shard=0)


def test_a_70b_model_with_adam_fits_8_stages_once_sharded_over_8() -> None:
    """Llama-3-70B-shaped in bfloat16, Adam, 8 stages of 80 GiB, 8 micro-batches of one
    4096-token sequence: pipelining alone does not fit (weights, gradients and Adam state are
    ~66 GiB per device); each stage sharded over the 8 replicas of a 64-device grid fits, with
    the state per rank about an eighth."""
    pytest.importorskip("transformers")
    from tests._llama70b import llama3_70b_profiled

    prof = llama3_70b_profiled().profile.with_optimizer("adam")
    options = dict(devices=8, capacity="80GiB", chunks=8, schedule="1f1b", checkpoint="always")
    with pytest.raises(ValueError, match=r"over 8 devices fits.*shard=n here"):
        pipepar.plan(prof, **options)
    fitted = pipepar.plan(prof, **options, shard=8)
    assert fitted.peak_bytes <= 80 * 2**30
    whole = prof.total("params_bytes") + prof.total("grads_bytes") + prof.total("optimizer_bytes")
    assert resident_bytes(prof, 8) <= 1.01 * whole / 8


def test_the_cli_takes_the_shard_group(tmp_path: Path) -> None:
    args = ["profile", "models.mlp", "--input-shape", "32,1024", "--devices", "2", "--quiet"]
    assert cli([*args, "--shard", "4", "--json", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["config"]["shard"] == 4
    assert cli([*args, "--shard", "0"]) == 2
