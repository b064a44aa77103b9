"""On the meta device, attention is traced the way real devices run it: fused.

``scaled_dot_product_attention`` on real tensors runs a fused kernel (flash attention on the CPU
and on CUDA) that keeps only its output and a log-sum-exp per row for backward. On ``meta``
torch falls back to the unfused math path, which also keeps the ``T x T`` attention
probabilities: a meta profile of a transformer would count memory no real device holds (20% of
a GPT block's activations at 64 tokens, more at longer sequences). While a meta profile runs,
:class:`FusedAttention` routes each call the fused kernel accepts (no explicit mask, or a
boolean/float mask the kernel takes, no grouped key-value heads) to that kernel's meta
implementation, so the saved tensors are the ones the real run saves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FusedAttention"]


class FusedAttention(TorchFunctionMode):
    """Trace ``F.scaled_dot_product_attention`` on meta tensors as the fused kernel.

    Example:
        >>> q = torch.empty(2, 4, 64, 32, device="meta", requires_grad=True)
        >>> with FusedAttention():
        ...     out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> out.shape
        torch.Size([2, 4, 64, 32])
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _fusable(*args, **kwargs):
            return _fused(*args, **kwargs)
        return func(*args, **kwargs)


def _fusable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *args: Any,
    enable_gqa: bool = False,
    **kwargs: Any,
) -> bool:
    same = query.dim() == 4 and key.shape[1] == query.shape[1] == value.shape[1]
    return query.is_meta and same and not enable_gqa and attn_mask is None


def _fused(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(query, key, value, dropout_p, is_causal, scale=scale)[0]
