"""A one-row batch of packed documents cut at document boundaries across two gloo ranks: a tiny
Llama's loss and gradients equal the plain model's on the same packed batch (learned, then
followed), and a model letting documents see each other is refused on every rank."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests._ranks import spawn
from tests.program._real import ranks_equal_plain
from tests.program.test_packed_sequences import llama, packed

pytestmark = pytest.mark.slow


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    model = llama()
    state = copy.deepcopy(model.state_dict())
    pipe = ppd.wrap(model, split=["model.layers.2"], chunks=3, schedule="1f1b", state_dict=state)
    out: dict[str, Any] = {}
    pipe.step(**packed())  # learns, then follows what it learned
    pipe.zero_grad()
    loss = pipe.step(**packed())
    out["step"] = (loss, {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()})
    pipe.zero_grad()
    mixed = {**packed(), "attention_mask": torch.ones(1, 34, dtype=torch.long)}
    try:
        pipe.step(**mixed)
        out["mixed"] = "no error"
    except Exception as err:  # every rank stops before any gradient
        out["mixed"] = f"{type(err).__name__}: {err}"
    out["grads after refusal"] = [p.grad is None for p in pipe.parameters()]
    pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def test_step_across_ranks_equals_the_plain_model(ranks: dict[int, Any]) -> None:
    plain = llama()
    loss = plain(**packed()).loss
    loss.backward()
    ranks_equal_plain([ranks[r]["step"] for r in (0, 1)], loss, plain)


def test_documents_seeing_each_other_are_refused_on_every_rank(ranks: dict[int, Any]) -> None:
    for r in (0, 1):
        assert "lets packed documents see each other" in ranks[r]["mixed"], ranks[r]["mixed"]
        assert all(ranks[r]["grads after refusal"]), r
