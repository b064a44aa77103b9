"""Multimodal models need no declaration across two gloo ranks either: Qwen2-VL (images and a
video) and Llava, rows holding zero to two images, train (``step``) and evaluate equal to the
plain model on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._ranks import spawn
from tests.program._vision_language import MODELS, SPLIT, batch_of, model_and_plain

pytestmark = pytest.mark.slow

SCHEDULES = {"qwen2_vl": "1f1b", "llava": "gpipe"}


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    out: dict[str, Any] = {}
    for name, schedule in SCHEDULES.items():
        model, _ = model_and_plain(name)
        pipe = ppd.wrap(model, split=SPLIT, chunks=4, schedule=schedule)
        batch = batch_of(name)
        loss = pipe.step(**batch)
        grads = {  # arrays: tensors would come back through shared memory
            k: p.grad.numpy().copy() for k, p in pipe.named_parameters() if p.grad is not None
        }
        out[name] = (loss, grads)
        with torch.no_grad():
            evaluated = pipe(**batch)
        out[f"{name} logits"] = None if evaluated is None else evaluated.logits.numpy().copy()
        pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("name", list(MODELS))
def test_step_and_evaluation_equal_the_plain_model(ranks: dict[int, Any], name: str) -> None:
    _, plain = model_and_plain(name)
    batch = batch_of(name)
    loss = plain(**batch).loss
    loss.backward()
    for r in sorted(ranks):
        torch.testing.assert_close(ranks[r][name][0], loss.item(), rtol=1e-5, atol=1e-6)
    got = {k: g for r in sorted(ranks) for k, g in ranks[r][name][1].items()}
    want = {k: p.grad for k, p in plain.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for key, grad in want.items():
        torch.testing.assert_close(torch.from_numpy(got[key]), grad, rtol=1e-5, atol=1e-6, msg=key)
    plain.eval()
    with torch.no_grad():
        ref = plain(**batch).logits
    logits = torch.from_numpy(ranks[1][f"{name} logits"])
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-6)
