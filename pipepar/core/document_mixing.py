"""Whether a model keeps packed documents apart: the check a cut between documents needs.

A one-row batch of packed documents cut at document boundaries gives each micro-batch some of
the documents. The plain model computes each document with the others beside it; the cut is
exact only if it never lets one document's tokens see another's. Nothing in the call says so:
transformers builds a block-diagonal causal mask from restarting position ids when no attention
mask is given and no cache is kept, but the same model given an all-ones attention mask, a
cache, or a model of other code attends across documents.

:class:`DocumentWatch` learns it from what micro-batch 0's forward does, once per kind of call,
on a micro-batch holding at least two documents. A torch-function mode, it looks at:

* every ``F.scaled_dot_product_attention`` whose queries and keys are the micro-batch's tokens:
  its mask must forbid every pair of tokens of two documents (``False``, or ``-inf`` / the
  dtype's lowest value added); ``is_causal`` or no mask lets them mix;
* every softmax over the last dimension of a ``(..., t, t)`` value (eager attention's weights):
  its weights between two documents must be exactly 0;
* floating-point convolutions over a dimension of ``t`` and cumulative operations along one
  (``cumsum``...): they carry a token into the next ones, whatever the documents; refused.

At least one attention must be seen (a model with none, or with a kernel the mode does not see,
is refused: its independence is not established). Values on the meta device (another rank's
stage) are counted as seen and checked by the rank that computes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from pipepar.core.reductions import BatchCoupled

__all__ = ["DocumentWatch", "DocumentsMixed"]


class DocumentsMixed(BatchCoupled):
    """A model that lets packed documents see each other (or one whose independence cannot be
    established), asked to cut between them: refused at the first call, before any gradient."""


class DocumentWatch(TorchFunctionMode):
    """Watches one micro-batch's forward for operations that mix its documents.

    Args:
        lengths: the micro-batch's documents' lengths, in token order.

    Example:
        >>> q = torch.randn(1, 1, 4, 2)
        >>> mask = torch.block_diag(torch.ones(2, 2), torch.ones(2, 2)).bool()
        >>> with DocumentWatch([2, 2]) as watch:
        ...     _ = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        >>> watch.verdict()
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        super().__init__()
        if len(lengths) < 2:
            raise DocumentsMixed(
                f"micro-batch 0 holds one document ({lengths[0] if lengths else 0} tokens), so "
                "whether the model keeps documents apart cannot be seen before cutting between "
                "them; pass fewer chunks (each micro-batch then holds several documents), or "
                "chunks=1"
            )
        self.tokens = sum(lengths)
        with _plain():  # a real tensor, whatever modes the forward runs under (a shadow stage)
            ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
            self._apart = ids[:, None] != ids[None, :]
        self.seen = 0
        self.mixing: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with _plain():
            self._look(func, args, kwargs, out)
        return out

    def verdict(self) -> None:
        """Raise :class:`DocumentsMixed` unless every operation seen kept documents apart and
        at least one attention was seen."""
        if self.mixing:
            raise DocumentsMixed(
                f"{self.mixing[0]}: the model lets packed documents see each other, so cutting "
                "between them would change what it computes. Let it keep them apart (transformers "
                "builds a block-diagonal mask from restarting position_ids when attention_mask "
                "is None and use_cache=False), or pass chunks=1"
            )
        if self.seen == 0:
            raise DocumentsMixed(
                "the model's forward ran no attention pipepar can see (F.scaled_dot_product_"
                "attention, or a softmax over tokens x tokens), so that it keeps packed documents "
                "apart is not established; use attn_implementation='sdpa' or 'eager', or pass "
                "chunks=1"
            )

    # -- what each operation does with the tokens ---------------------------------------------
    def _look(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is F.scaled_dot_product_attention:
            self._attention(args, kwargs)
        elif func in _SOFTMAX and isinstance(out, Tensor):
            self._weights(args, kwargs, out)
        elif func in _CONVOLUTIONS:
            self._convolution(func, args)
        elif getattr(func, "__name__", "") in _CUMULATIVE:
            self._cumulative(func, args, kwargs)

    def _attention(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k = bound["query"], bound["key"]
        if q.shape[-2] != self.tokens or k.shape[-2] != self.tokens:
            return
        self.seen += 1
        mask = bound.get("attn_mask")
        if q.device.type == "meta" or (mask is not None and mask.device.type == "meta"):
            return
        if mask is None:
            causal = " with is_causal=True" if bound.get("is_causal") else ""
            self.mixing.append(f"F.scaled_dot_product_attention{causal} without a mask")
            return
        blocked = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min
        blocked = blocked.expand(*blocked.shape[:-2], self.tokens, self.tokens).cpu()
        if not bool(blocked[..., self._apart].all()):
            self.mixing.append("F.scaled_dot_product_attention's mask lets documents attend")

    def _weights(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        if out.dim() < 2 or tuple(out.shape[-2:]) != (self.tokens, self.tokens):
            return
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim not in (-1, out.dim() - 1):
            return
        self.seen += 1
        if out.device.type != "meta" and bool((out.detach()[..., self._apart] != 0).any()):
            self.mixing.append("a softmax over tokens gives weight to other documents' tokens")

    def _convolution(self, func: Any, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.is_floating_point() and self.tokens in x.shape[2:]:
            self.mixing.append(f"{func.__name__}() over the tokens carries them across documents")

    def _cumulative(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else None
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or not x.is_floating_point() or not isinstance(dim, int):
            return
        if x.dim() and x.shape[dim] == self.tokens:
            self.mixing.append(f"{func.__name__}() along the tokens carries them across documents")


def _plain() -> contextlib.ExitStack:
    """Outside every torch-function and dispatch mode: what the watch computes is its own."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C.DisableTorchFunction())
    stack.enter_context(_disable_current_modes())
    return stack


_SOFTMAX = {F.softmax, torch.softmax, Tensor.softmax}
_CONVOLUTIONS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"}
