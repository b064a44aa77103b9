"""Models whose code decides shapes and paths from values, across two gloo ranks: transformers'
sliding-window attention (Mistral with its key-value cache, Gemma2's sliding and full layers)
and mixture-of-experts routing (Mixtral, Qwen3-MoE); the loss and every gradient equal the
plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests._ranks import spawn
from tests.program._data_models import NAMES, batch, build
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow
SPLIT = "model.layers.1"


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


def _eager_experts() -> str:
    """Mixtral's eager experts loop over the experts ``nonzero`` picks from the router's
    choice, which no rank following the other's stage knows: the error each rank ends with."""
    import pipepar.distributed as ppd

    pipe = ppd.wrap(build("mixtral", experts="eager"), split=[SPLIT], chunks=2)
    try:
        pipe.step(**batch())
    except Exception as err:
        return str(err)
    finally:
        pipe.close()
    return "no error"


def _two_ranks(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: _one_model(name) for name in NAMES}
    out["eager"] = _eager_experts()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_the_plain_model(ranks: dict[int, Any], name: str) -> None:
    """Sliding windows: the first stage makes the key-value cache's constants (a sliding-window
    layer's window as a tensor); the second stage's rank follows it on meta and receives them,
    as the first stage's rank sends them. Experts: the ranks follow each other's
    ``grouped_mm`` on meta, which refuses float32 there."""
    plain = build(name)
    loss = plain(**batch()).loss
    loss.backward()
    ranks_equal_plain([ranks[r][name] for r in (0, 1)], loss, plain)


def test_a_shape_decided_by_another_ranks_activations_ends_naming_the_operation_and_module(
    ranks: dict[int, Any],
) -> None:
    for r in (0, 1):
        text = ranks[r]["eager"]
        assert "aten.nonzero" in text and "experts (MixtralExperts)" in text, (r, text)
