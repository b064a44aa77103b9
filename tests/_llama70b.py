"""Llama-3-70B-shaped in bfloat16 on ``meta`` and its profile of a batch of 8 sequences of 4096
tokens, made once per test session for the tests that look at it or plan it: building the
model and tracing it on meta take seconds each, and neither touches the model (a profile runs
stand-ins for its parameters; ``untouched`` puts back what a forward stores)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from pipepar.planner.profile import Profile

__all__ = ["Profiled", "llama3_70b_bf16", "llama3_70b_profiled"]


@dataclass(frozen=True)
class Profiled:
    """The model's profile (no optimizer: ``Profile.with_optimizer`` adds one) and the seconds
    that building the model and profiling it took, for the tests that bound them."""

    profile: Profile
    seconds: float


@functools.cache
def _built() -> tuple[nn.Module, float]:
    from models import transformers_zoo as zoo

    start = time.perf_counter()
    model = zoo.llama3_70b().to(torch.bfloat16)
    return model, time.perf_counter() - start


def llama3_70b_bf16() -> nn.Module:
    """``zoo.llama3_70b()`` in bfloat16 on meta, one model for the session: do not modify it."""
    return _built()[0]


@functools.cache
def llama3_70b_profiled() -> Profiled:
    """:func:`profile_model` of :func:`llama3_70b_bf16` on ``input_ids`` and ``labels`` of
    shape (8, 4096) on meta; ``seconds`` counts the model's build too."""
    from pipepar.planner.model_profile import profile_model

    model, built = _built()
    start = time.perf_counter()
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    prof = profile_model(model, dict(input_ids=ids, labels=ids))
    return Profiled(prof, built + time.perf_counter() - start)
