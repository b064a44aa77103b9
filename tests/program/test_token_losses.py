"""Losses over tokens, not rows: padded labels (-100), masked prompts and a count passed as
``num_items_in_batch`` (HF Trainer's way). The pipe's loss and every gradient equal the plain
model's on the whole batch, however many real tokens each micro-batch holds (none included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from models import transformers_zoo as zoo

pytest.importorskip("transformers")

RTOL = 1e-5
SPLITS = {"gpt2": "transformer.h.2", "llama": "model.layers.2", "bert": "bert.encoder.layer.2"}


def padded(name: str, rows: int = 6) -> dict[str, torch.Tensor]:
    return zoo.padded_sample(name, batch=rows)


def _pair(name: str, chunks: int, **wrap: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = zoo.build(name)
    pipe = pipepar.wrap(
        copy.deepcopy(plain),
        split=wrap.pop("split", [SPLITS[name]]),
        devices=wrap.pop("devices", ["cpu", "cpu"]),
        chunks=chunks,
        **wrap,
    )
    return plain, pipe


def _check_grads(pipe: nn.Module, plain: nn.Module) -> None:
    theirs = dict(plain.named_parameters())
    for n, p in pipe.named_parameters():
        g, ref = p.grad, theirs[n].grad
        assert g is not None and ref is not None, n
        # relative to the largest gradient of the model: some are zero up to rounding
        err = ((g - ref).abs().max() / _scale(plain)).item()
        assert err < RTOL, f"{n}: relative error {err:.2e}"


def _scale(model: nn.Module) -> float:
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("how", ["call", "step", "call+count", "step+count"])
def test_padded_token_loss_equals_plain(name: str, chunks: int, how: str) -> None:
    plain, pipe = _pair(name, chunks)
    batch = padded(name)
    if how.endswith("count"):  # HF Trainer passes the count of its whole (accumulated) batch
        batch["num_items_in_batch"] = torch.tensor(23)
    expected = plain(**batch).loss
    expected.backward()
    if how.startswith("step"):
        loss = pipe.step(**batch)
    else:
        loss = pipe(**batch).loss
        loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=RTOL, atol=0)
    _check_grads(pipe, plain)


@pytest.mark.parametrize(
    ("schedule", "layout"),
    [
        ("gpipe", ["transformer.h.1"]),
        ("1f1b", ["transformer.h.3"]),  # uneven: 3 + 1 blocks
        ("zb-h1", ["transformer.h.2"]),
        ("interleaved-1f1b", ["transformer.h.1", "transformer.h.2", "transformer.h.3"]),
        ("zb-v", ["transformer.h.1", "transformer.h.2", "transformer.h.3"]),
    ],
)
def test_every_schedule_joins_token_losses(schedule: str, layout: list[str]) -> None:
    plain, pipe = _pair("gpt2", 3, split=layout, schedule=schedule)
    batch = padded("gpt2", rows=7)
    batch["labels"][4:, :] = -100  # the last micro-batch holds no label at all
    expected = plain(**batch).loss
    expected.backward()
    loss = pipe.step(**batch)
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=0)
    _check_grads(pipe, plain)


def test_a_custom_loss_fn_over_tokens_says_what_it_counts() -> None:
    plain, pipe = _pair("llama", 4)
    batch = padded("llama")
    labels = batch.pop("labels")

    def loss_fn(out: object, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)

    expected = loss_fn(plain(**batch), labels)
    expected.backward()
    # A custom loss says what it averages over: the real labels of each micro-batch's target.
    loss = pipe.step(**batch, loss_fn=loss_fn, target=labels, items=lambda y: (y != -100).sum())
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=0)
    _check_grads(pipe, plain)
