"""Declared cutting across two gloo ranks: a model whose images are packed over the batch
(``split_inputs={"pixel_values": pipepar.Packed(...)}``) trains and evaluates as the plain
model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import pipepar
from tests._ranks import spawn
from tests.program._packed_toy import PackedImages, packed_batch, patches_per_row
from tests.program._real import ranks_equal_plain

pytestmark = pytest.mark.slow


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = PackedImages()
    state = copy.deepcopy(model.state_dict())
    pipe = ppd.wrap(
        model,
        split=["blocks.1"],
        chunks=4,
        schedule="1f1b",
        state_dict=state,
        split_inputs={"pixel_values": pipepar.Packed(patches_per_row)},
    )
    loss = pipe.step(**packed_batch())
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    with torch.no_grad():
        out = pipe(**packed_batch())
    pipe.close()
    # the image states are stage 0's: on the last stage's rank they stand on meta, joined
    joined = None if out is None else {k: v.cpu() if not v.is_meta else v for k, v in out.items()}
    return {"step": (loss, grads), "eval": joined}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


def test_packed_images_train_and_evaluate_as_the_plain_model(ranks: dict[int, Any]) -> None:
    torch.manual_seed(0)
    plain = PackedImages()
    ref = plain(**packed_batch())
    ref["loss"].backward()
    ranks_equal_plain([ranks[r]["step"] for r in (0, 1)], ref["loss"], plain)
    assert ranks[0]["eval"] is None
    got = ranks[1]["eval"]
    for key in ("logits", "loss"):
        torch.testing.assert_close(got[key], ref[key].detach(), rtol=1e-5, atol=1e-6)
    assert got["image_hidden_states"].shape == ref["image_hidden_states"].shape
