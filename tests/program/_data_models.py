"""Tiny transformers models whose code decides shapes and paths from values: sliding-window
attention (Mistral, Gemma2) and mixtures of experts (Mixtral, Qwen3-MoE), and a batch longer
than their window."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["NAMES", "batch", "build"]

NAMES = ("mistral", "gemma2", "mixtral", "qwen3moe")


def build(name: str, experts: str | None = None) -> nn.Module:
    """A tiny ``name`` with random weights, as users build it (its key-value cache on); a
    mixture of experts with transformers' default experts, or ``experts``."""
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
    moe: nn.Module | None = None
    if name == "mixtral":
        config = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes)
        moe = tf.MixtralForCausalLM(config)
    if name == "qwen3moe":
        config = tf.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **sizes
        )
        moe = tf.Qwen3MoeForCausalLM(config)
    if moe is not None:
        if experts is not None:
            moe.config._experts_implementation = experts
        return moe
    raise ValueError(f"unknown model {name!r}; choose one of {NAMES}")


def batch() -> dict[str, torch.Tensor]:
    """Four rows of 16 tokens, longer than the window of 4; rows 0 and 2 padded on the left."""
    ids = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
