"""One training loop, both runtimes: the same cases (accumulation over calls, clipping by the
whole model's norm, evaluation between steps, frozen tied weights, LoRA adapters, a sequence
length that changes per step, a batch smaller than chunks) through a one-process pipe and two
gloo ranks (pp=2), each against the plain model. Four ranks (pp=2 x dp=2, zb-h1) launched by
torchrun run them as two nodes in test_multinode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests._ranks import spawn
from tests.distributed import _loop

RTOL = 1e-5


CASES = _loop.installed()


def _same(got: dict[str, Any], want: dict[str, Any], where: str, rtol: float = RTOL) -> None:
    for key in ("loss", "norm", "eval"):
        assert len(got[key]) == len(want[key]), (where, key)
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= rtol * max(abs(b), 1e-6), f"{where}: {key} {got[key]} {want[key]}"
    # computed in the caller's autocast dtype (where this process computes the output)
    assert got["dtype"] in (None, want["dtype"]), (where, got["dtype"], want["dtype"])
    frozen = got["frozen_grads"]
    assert frozen == [], f"{where}: frozen weights got gradients: {frozen}"
    scale = max(w.abs().max().item() for w in want["weights"].values())
    for name, w in got["weights"].items():
        err = (w - want["weights"][name]).abs().max().item() / scale
        assert err < rtol, f"{where}: weight {name} off by {err:.2e}"


def check_ranks(ranks: list[dict[str, Any]], plain: dict[str, dict[str, Any]], label: str) -> None:
    """Every case on every rank equals the plain model's run, and the ranks together hold
    every weight."""
    for case in CASES:
        seen: set[str] = set()
        for r, results in enumerate(ranks):
            got = results[case]
            assert not isinstance(got, str), f"rank {r}, {case}:\n{got}"
            where = f"rank {r} of {len(ranks)} ({label}), {case}"
            _same(got, plain[case], where, _loop.TOLERANCE.get(case, RTOL))
            seen |= set(got["weights"])
        trained = {n for n, p in plain[case]["weights"].items()}
        assert seen == trained, f"{case}: no rank holds {trained - seen}"
        assert any(r[case]["dtype"] is not None for r in ranks), case  # the last stage's ranks


@pytest.mark.parametrize("case", CASES)
def test_one_process_loop_equals_plain(case: str, loop_plain: dict[str, dict[str, Any]]) -> None:
    got = _loop.one_process(case)
    assert got["dtype"] == loop_plain[case]["dtype"]
    _same(got, loop_plain[case], "one process", _loop.TOLERANCE.get(case, RTOL))


def _loop_rank(rank: int) -> dict[str, Any]:
    """Every case on this rank of a pp=2 1f1b pipe (the process group is already up); the
    weights as arrays (a tensor would cross back as a handle to this process's memory, which
    is gone once it exits)."""
    _loop.settle()
    results = {case: _loop.on_ranks(case, 1, "1f1b") for case in CASES}
    for got in results.values():
        got["weights"] = {name: w.numpy() for name, w in got["weights"].items()}
    return results


@pytest.mark.slow
def test_ranks_loop_equals_plain(loop_plain: dict[str, dict[str, Any]]) -> None:
    got = spawn(2, _loop_rank, timeout=300)
    ranks = [got[r] for r in range(2)]
    for results in ranks:
        for case in results.values():
            case["weights"] = {name: torch.from_numpy(w) for name, w in case["weights"].items()}
    check_ranks(ranks, loop_plain, "pp=2, 1f1b")
