"""Recompute across two gloo ranks of a model that builds a key-value cache in training
(transformers' Gemma2, eager attention; the second rank's layer a sliding-window one): each
recomputed layer gets the cache as its first run found it, with the values another rank's stage
made (held on ``meta`` there) as the first run received them; the loss and gradients equal the
plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests._ranks import spawn
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def _gemma2() -> Any:
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _two_ranks(rank: int) -> tuple[float, dict[str, Any]]:
    import pipepar.distributed as ppd

    model = _gemma2()
    pipe = ppd.wrap(
        model, split=["model.layers.2"], chunks=2, checkpoint="always",
        state_dict=copy.deepcopy(model.state_dict()),
    )  # fmt: skip
    pipe.step(**_batch())  # learns the route, then follows it
    pipe.zero_grad()
    loss = pipe.step(**_batch())
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return float(loss), grads


def test_a_cache_built_in_training_is_recomputed_as_it_was() -> None:
    got = spawn(2, _two_ranks)
    plain = _gemma2()
    loss = plain(**_batch()).loss
    loss.backward()
    ranks_equal_plain([got[r] for r in (0, 1)], loss, plain)
