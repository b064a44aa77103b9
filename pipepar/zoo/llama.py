"""transformers' Llama built from sizes, with random weights: small ones for trying a pipe, and
the shape of Llama 3 70B for planning on ``meta`` (``pipepar plan pipepar.zoo:llama3_70b``).

transformers is imported when a builder runs (``pip install pipepar[hf]``), not before.
"""

from __future__ import annotations

from torch import nn

from pipepar.zoo.building import DeviceLike, on_device

__all__ = ["llama", "llama3_70b"]


def llama(
    *,
    layers: int = 4,
    hidden: int = 32,
    intermediate: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    positions: int = 256,
    dropout: float = 0.0,
    device: DeviceLike = None,
) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` (grouped-query attention, rotary positions).

    Args:
        layers: decoder layers.
        hidden: hidden size.
        intermediate: the feed-forward's inner size.
        heads: attention heads.
        kv_heads: key-value heads (grouped-query attention when fewer than ``heads``).
        vocab: vocabulary size.
        positions: the longest sequence.
        dropout: attention dropout (off by default: a pipe then computes the plain model's
            numbers exactly).
        device: where to build it, e.g. ``"meta"`` to allocate nothing.

    Returns:
        The model, without a key-value cache (``use_cache=False``, for training).

    Example:
        >>> model = llama(layers=2)
        >>> model(input_ids=torch.randint(128, (2, 8))).logits.shape
        torch.Size([2, 8, 128])
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise ImportError(
            "pipepar.zoo.llama needs transformers, which is not installed; "
            "pip install 'pipepar[hf]' (or pip install transformers)"
        ) from None

    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        attention_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    with on_device(device):
        return LlamaForCausalLM(config)


def llama3_70b(*, device: DeviceLike = "meta") -> nn.Module:
    """A Llama-3-70B-shaped ``LlamaForCausalLM`` (80 layers, hidden 8192, intermediate 28672,
    64 heads with 8 key-value heads, vocabulary 128256, sequence 4096), on ``meta``: shapes to
    plan, no memory.

    Example:
        >>> sum(p.numel() for p in llama3_70b().parameters()) > 70e9
        True
    """
    return llama(
        layers=80,
        hidden=8192,
        intermediate=28672,
        heads=64,
        kv_heads=8,
        vocab=128256,
        positions=4096,
        device=device,
    )
