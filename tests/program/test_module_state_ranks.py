"""A value a module keeps between calls, followed on meta by the ranks that do not compute it:
a dynamic rotary embedding (transformers' Llama, ``rope_type="dynamic"``) records the longest
length it grew for, and the next micro-batch compares with it. The rank of stage 1 follows
stage 0's code in shadow, where that length is a meta tensor whose value it must know."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests._ranks import spawn
from tests.planner.test_planning_leaves_no_trace import _dynamic_rope_llama
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(1))


def _two_ranks(rank: int) -> list[tuple[float, dict[str, Any]]]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = _dynamic_rope_llama()
    state = copy.deepcopy(model.state_dict())
    pipe = ppd.wrap(model, split=["model.layers.1"], chunks=2, schedule="1f1b", state_dict=state)
    steps = []
    for _ in range(2):  # the second step reads what the first one kept
        loss = pipe.step(input_ids=_ids(), labels=_ids())
        steps.append((loss, {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}))
        pipe.zero_grad()
    pipe.close()
    return steps


def test_a_dynamic_rope_llama_trains_across_ranks_as_the_plain_model() -> None:
    ranks = spawn(2, _two_ranks)
    torch.manual_seed(0)
    plain = _dynamic_rope_llama()
    loss = plain(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    for step in (0, 1):
        ranks_equal_plain([ranks[r][step] for r in (0, 1)], loss, plain)
