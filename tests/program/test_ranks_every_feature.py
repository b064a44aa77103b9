"""Every feature for every real model across ranks: the five models (GPT-2 with its tied head,
Llama, BERT, timm's and torchvision's ViT) x every schedule x every checkpoint mode on two gloo
ranks. Over two steps (the first learns the route, the second follows it) each rank's loss and
gradients equal the plain model's, and the ranks together hold every weight."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("timm")

from models import transformers_zoo as zoo
from tests._ranks import spawn
from tests.program._real import SPLITS

pytestmark = pytest.mark.slow
RTOL = 1e-5
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]
MODES = ["never", "always", "except_last"]
CASES = list(itertools.product(SPLITS, SCHEDULES, MODES))
STEPS = 2


def _loss_fn(name: str) -> Any:
    if name.startswith("vit"):
        return lambda out, _: out.float().logsumexp(-1).mean()
    return None


def _batch(name: str, step: int) -> dict[str, Any]:
    if name.startswith("vit"):
        return zoo.sample(name, batch=4, seed=step)
    return zoo.padded_sample(name, batch=4, seq=8, seed=step)


def _split(name: str, schedule: str) -> list[str]:
    """Four stages for the virtual-stage schedules (two per rank), else two."""
    return SPLITS[name] if schedule in ("interleaved-1f1b", "zb-v") else SPLITS[name][1:2]


def _steps(name: str, schedule: str, checkpoint: str) -> list[tuple[float, dict[str, Any]]]:
    """``STEPS`` steps of this rank's stages: each one's loss and this rank's gradients."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build(name)
    pipe = ppd.wrap(
        model, split=_split(name, schedule), chunks=2, schedule=schedule, checkpoint=checkpoint
    )
    out = []
    for step in range(STEPS):
        pipe.zero_grad(set_to_none=True)
        loss = pipe.step(**_batch(name, step), loss_fn=_loss_fn(name))
        grads = {n: p.grad.numpy().copy() for n, p in pipe.named_parameters() if p.grad is not None}
        out.append((loss, grads))
    pipe.close()
    return out


def _two_ranks(rank: int) -> dict[tuple[str, str, str], Any]:
    return {case: _steps(*case) for case in CASES}


@pytest.fixture(scope="module")
def two() -> dict[int, Any]:
    return spawn(2, _two_ranks, timeout=600.0)


def _plain(name: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """The plain model's loss and gradients over the same steps."""
    torch.manual_seed(0)
    plain = zoo.build(name)
    loss_fn = _loss_fn(name)
    out = []
    for step in range(STEPS):
        plain.zero_grad(set_to_none=True)
        batch = _batch(name, step)
        output = plain(**batch)
        loss = loss_fn(output, None) if loss_fn is not None else output.loss
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in plain.named_parameters()}))
    return out


@pytest.mark.parametrize("name", list(SPLITS))
def test_every_schedule_and_checkpoint_mode_across_ranks_equals_the_plain_model(
    two: dict[int, Any], name: str
) -> None:
    expected = _plain(name)
    for schedule, checkpoint in itertools.product(SCHEDULES, MODES):
        held: set[str] = set()
        for r in (0, 1):
            got = two[r][(name, schedule, checkpoint)]
            where = f"{name} {schedule} checkpoint={checkpoint} rank {r}"
            for step, ((loss, grads), (plain_loss, plain_grads)) in enumerate(zip(got, expected)):
                assert abs(loss - plain_loss) <= RTOL * abs(plain_loss), (where, step)
                for key, g in grads.items():
                    ref = plain_grads[key]
                    scale = ref.abs().max().clamp_min(1e-6)
                    err = ((torch.from_numpy(g) - ref).abs().max() / scale).item()
                    assert err < RTOL, f"{where} step {step}: gradient of {key}, error {err:.2e}"
                    held.add(key)
        assert held == set(expected[0][1]), (name, schedule, checkpoint)
