"""Weights frozen or unfrozen after ``wrap`` (``requires_grad_``, as a fine-tuning does between
its phases) take a gradient exactly when they would in the plain model (pipepar.program.compute
reads which weights train at each call)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import pipepar
from models import transformers_zoo as zoo

CPU2 = ["cpu", "cpu"]
SPLITS = {"1f1b": ["transformer.h.2"], "zb-v": [f"transformer.h.{k}" for k in (1, 2, 3)]}


def _freeze_embeddings_and_last_block(m: nn.Module) -> None:
    m.transformer.wpe.requires_grad_(False)
    m.transformer.h[3].requires_grad_(False)  # on the last stage


def _freeze_tied_and_first_block(m: nn.Module) -> None:
    m.transformer.wte.requires_grad_(False)  # tied to the head, on the other stage
    m.transformer.h[0].requires_grad_(False)


@pytest.mark.parametrize(
    "freeze", [_freeze_embeddings_and_last_block, _freeze_tied_and_first_block]
)
@pytest.mark.parametrize("how", ["call", "step"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_freezing_then_unfreezing_after_wrap_trains_as_the_plain_model(
    schedule: str, how: str, freeze: Callable[[nn.Module], None]
) -> None:
    torch.manual_seed(0)
    model = zoo.gpt2(layers=4, hidden=32, heads=2, vocab=64, positions=12)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=SPLITS[schedule], devices=CPU2, chunks=4, schedule=schedule)
    batch = {"input_ids": torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"]
    runs: dict[str, Callable[[nn.Module], object]] = {
        "call": lambda m: m(**batch).loss.backward(),
        "step": lambda m: pipe.step(**batch) if m is pipe else m(**batch).loss.backward(),
    }
    backward = runs[how]

    for phase in ("all", "frozen", "unfrozen"):
        for m in (plain, pipe):
            if phase == "frozen":
                freeze(m)
            elif phase == "unfrozen":
                m.requires_grad_(True)
            m.zero_grad(set_to_none=True)
            backward(m)
        for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
            assert (p.grad is None) == (q.grad is None), (phase, name)
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"{phase} {name}")
    pipe.close()
