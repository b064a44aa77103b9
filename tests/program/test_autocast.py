"""Real models under ``torch.autocast`` on the CPU (bfloat16, float32 weights): a pipe's step
follows the plain model's step under the same autocast, in every schedule, in one process.
Under autocast a Linear computes with a bfloat16 copy of its weight; the split backward's W
makes those weights' gradients directly (no autograd pass, no graph kept for W)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import pipepar
from models import transformers_zoo as zoo
from pipepar.core.schedule import VIRTUAL
from tests.program import _real as real
from tests.program._real import SPLITS

RTOL = 3e-2  # bfloat16: a few roundings in another order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_step_under_autocast_follows_the_plain_model(name: str, schedule: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    split = SPLITS[name] if schedule in VIRTUAL else SPLITS[name][1:2]
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=split, devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    batch = zoo.padded_sample(name, batch=8, seq=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(**batch)
        expected = plain(**batch).loss
    expected.backward()
    real._close(loss.detach(), expected.detach().float(), "loss", RTOL)
    real._same_grads(pipe, plain, RTOL)


def _on_ranks(rank: int) -> tuple[float, dict[str, Any]]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build("gpt2")
    pipe = ppd.wrap(model, split=SPLITS["gpt2"], chunks=4, schedule="zb-v")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(**zoo.padded_sample("gpt2", batch=8, seq=12))
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}
    pipe.close()
    return float(loss), grads


@pytest.mark.slow
def test_ranks_under_autocast_follow_the_plain_model() -> None:
    from tests._ranks import spawn

    ranks = spawn(2, _on_ranks)
    torch.manual_seed(0)
    plain = zoo.build("gpt2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(**zoo.padded_sample("gpt2", batch=8, seq=12)).loss
    expected.backward()
    want = dict(plain.named_parameters())
    seen = set()
    for r in (0, 1):
        loss, grads = ranks[r]
        real._close(torch.tensor(loss), expected.detach().float(), f"rank {r}'s loss", RTOL)
        for name, g in grads.items():
            real._close(torch.from_numpy(g), want[name].grad, f"rank {r}: {name}", RTOL)
            seen.add(name)
    assert seen == set(want)
