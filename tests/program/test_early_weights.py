"""W actions run early while a rank waits for another rank's gradients
(pipepar.program.early_weights): the W actions keep their order and the waiting B computes no
weight gradient, so every gradient is bit for bit the one of the schedule's own order."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from models import transformers_zoo as zoo
from pipepar.core.schedule import Action
from pipepar.program.early_weights import EarlyWeights
from tests._ranks import spawn

pytestmark = pytest.mark.slow
SPLIT = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]  # zb-v: stages 0 and 3 on rank 0


def _steps(early: bool, slow_rank: int | None) -> dict[str, Any]:
    """Two zb-v steps of GPT-2 (tied head) on this rank: the gradients after each and how
    many W actions ran early; ``slow_rank``'s backwards each take 20 ms longer (so the other
    rank waits for its gradients)."""
    import pipepar.distributed as ppd
    from pipepar.program import ranks

    os.environ["PIPEPAR_EARLY_WEIGHTS"] = "1" if early else "0"
    backward = ranks.RankStep.backward
    if slow_rank == torch.distributed.get_rank():

        def slow(self: Any, i: int, grads: Any) -> Any:
            time.sleep(0.02)
            return backward(self, i, grads)

        ranks.RankStep.backward = slow  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        pipe = ppd.wrap(zoo.gpt2(), split=SPLIT, chunks=4, schedule="zb-v")
        grads = []
        for step in range(2):
            pipe.step(**zoo.padded_sample("gpt2", batch=8, seq=8, seed=step))
            grads.append({n: p.grad.numpy().copy() for n, p in pipe.named_parameters()})
        early_runs = pipe._compute.weights_run_early
        pipe.close()
    finally:
        ranks.RankStep.backward = backward  # type: ignore[method-assign]
    return {"grads": grads, "early": early_runs}


def _both(rank: int) -> dict[str, Any]:
    out = {"in_order": _steps(False, 1), "early": _steps(True, 1)}
    os.environ["PIPEPAR_SHARED_MEMORY"] = "0"  # gloo's works tell their arrival too
    out["early_gloo"] = _steps(True, 1)
    return out


def test_weights_run_early_give_the_gradients_bit_for_bit() -> None:
    got = spawn(2, _both, timeout=300)
    assert got[0]["in_order"]["early"] == 0
    # rank 0 (stages 0 and 3) waits at its first stage's backwards for rank 1's gradients
    for run in ("early", "early_gloo"):
        assert got[0][run]["early"] > 0, run
        for r in (0, 1):
            pairs = zip(got[r]["in_order"]["grads"], got[r][run]["grads"])
            for step, (a, b) in enumerate(pairs):
                assert a.keys() == b.keys()
                for name in a:
                    assert (a[name] == b[name]).all(), f"{run}, rank {r} step {step}: {name}"


def _actions(text: str) -> list[Action]:
    return [Action(int(t[1]), t[0], int(t[3])) for t in text.split()]


def test_only_the_first_w_not_yet_run_runs_early_and_only_after_its_b() -> None:
    actions = _actions("F0.0 B0.0 B0.1 W0.0 F1.0 W0.1 B1.0 W1.0")
    order = EarlyWeights(actions)
    waiting = iter([False, False, False])  # never arrives
    ran = list(order.while_waiting(2, lambda: next(waiting)))
    assert [a for _, a in ran] == [actions[3]]  # W0.0 runs; W0.1 waits for B0.1
    assert order.ran(3) and not order.ran(5) and order.count == 1
    assert list(order.while_waiting(4, lambda: True)) == []  # arrived: nothing runs
    ran = list(order.while_waiting(4, lambda: False))
    assert [w for w, _ in ran] == [5]  # W0.1; then W1.0 waits for B1.0
