"""Models whose code decides shapes and paths from values, across two gloo ranks: transformers'
sliding-window attention (Mistral with its key-value cache, Gemma2's sliding and full layers)
and mixture-of-experts routing (Mixtral, Qwen3-MoE); the loss and every gradient equal the
plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tests._ranks import spawn
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow
NAMES = ("mistral", "gemma2")
SPLIT = "model.layers.1"


def build(name: str) -> nn.Module:
    """A tiny ``name`` with random weights, as users build it (its key-value cache on)."""
    import transformers as tf

    torch.manual_seed(0)
    sizes: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=4, **sizes))
    if name == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(sliding_window=4, head_dim=8, **sizes))
    raise ValueError(f"unknown model {name!r}; choose one of {NAMES}")


def batch() -> dict[str, torch.Tensor]:
    """Four rows of 16 tokens, longer than the window of 4; rows 0 and 2 padded on the left."""
    ids = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _one_model(name: str) -> tuple[float, dict[str, Any]]:
    import pipepar.distributed as ppd

    model = build(name)
    pipe = ppd.wrap(model, split=[SPLIT], chunks=2, state_dict=copy.deepcopy(model.state_dict()))
    pipe.step(**batch())  # the first step learns the route, the second follows it
    pipe.zero_grad()
    loss = pipe.step(**batch())
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads


def _two_ranks(rank: int) -> dict[str, Any]:
    return {name: _one_model(name) for name in NAMES}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_the_plain_model(ranks: dict[int, Any], name: str) -> None:
    """The first stage makes the key-value cache's constants (a sliding-window layer's window
    as a tensor); the second stage's rank follows it on meta and receives them, as the first
    stage's rank sends them."""
    plain = build(name)
    loss = plain(**batch()).loss
    loss.backward()
    ranks_equal_plain([ranks[r][name] for r in (0, 1)], loss, plain)
