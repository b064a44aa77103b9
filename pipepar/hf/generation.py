"""Generation through a pipe: the model's own ``generate`` loop, each forward call run by the pipe.

transformers' ``GenerationMixin.generate`` calls the model (``self(...)``) once for the prompt
(the prefill) and once per new token (a decode step), passing the key-value cache back in. While
:func:`generate` runs, the model's ``forward`` is routed to the pipe: every call of the loop is
split into micro-batches and run over the stages, its cache split and joined with it
(:mod:`pipepar.batching.caches`). The pipe's own micro-batch calls, which run on its drivers'
threads, still reach the model's real ``forward``. Everything is restored afterwards, also
on error.

This module runs a loop that exists; it does not write one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipepar.program import driver

if TYPE_CHECKING:
    from pipepar.local.pipe_view import PipeSettings

__all__ = ["generate", "routed"]

_ABSENT = object()


def generate(pipe: PipeSettings, *args: Any, **kwargs: Any) -> Any:
    """Run the wrapped model's own ``generate`` with every forward call going through ``pipe``.

    Takes the model's ``generate`` arguments (``input_ids``, ``attention_mask``,
    ``max_new_tokens``, ``do_sample``...) and returns what it returns. Runs without gradients.

    Example:
        >>> pipe.eval()
        >>> tokens = generate(pipe, input_ids=ids, max_new_tokens=8, do_sample=False)

    Raises:
        TypeError: the model has no ``generate`` method.
    """
    model = pipe.module
    loop = getattr(model, "generate", None)
    if not callable(loop):
        raise TypeError(
            f"pipe.generate runs the model's own generate(), but {type(model).__name__} has "
            "none; wrap a transformers language model (e.g. GPT2LMHeadModel, "
            "LlamaForCausalLM), or call the pipe in a decoding loop of your own"
        )
    with routed(model, pipe), torch.no_grad():
        return loop(*args, **kwargs)


@contextlib.contextmanager
def routed(model: nn.Module, pipe: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``model(...)`` called outside the pipe's micro-batches calls
    ``pipe(...)`` instead; inside a micro-batch (on a driver's thread) it is the model's own.

    The routing is an instance attribute ``forward``, wrapping the real one so that its
    signature (which ``generate`` inspects) stays the model's. A ``forward`` the instance had
    already is put back afterwards.
    """
    before = model.__dict__.get("forward", _ABSENT)
    real = model.forward

    @functools.wraps(real)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if driver.active() is not None:  # a micro-batch of the pipe: the model's own code
            return real(*args, **kwargs)
        return pipe(*args, **kwargs)

    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if before is _ABSENT:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = before
