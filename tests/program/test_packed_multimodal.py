"""Multimodal models of transformers need no declaration: their packed inputs (Qwen2-VL's
patches and grids of images and videos, Llava's images) are recognised from the placeholder
tokens of each row, cut with the rows that hold them, and a whole argument that the rows
would take in order is refused. Equal to the plain model on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.batching.packed_inputs import recognised
from pipepar.batching.rules import argument_keys
from tests.program._vision_language import (
    SPLIT,
    assert_grads_equal,
    batch_of,
    llava,
    llava_batch,
    model_and_plain,
    outputs_equal,
    qwen2_vl,
)

MODELS = ["qwen2_vl", "llava"]
KEYS = ("logits", "loss", "image_hidden_states")


def _pipe(model: nn.Module, **kwargs: object) -> pipepar.Pipe:
    return pipepar.wrap(model, split=SPLIT, devices=["cpu", "cpu"], chunks=4, **kwargs)


def test_the_rows_items_are_found_from_their_placeholder_tokens() -> None:
    batch = batch_of("qwen2_vl")  # patches 8, 0, 4+8 (and a video of 8), 4
    keys, values = list(batch), list(batch.values())
    found = recognised(qwen2_vl(), keys, values, [None] * len(keys), 4)
    lengths = {key: rule.packed.lengths({}).tolist() for key, rule in found.rules.items()}
    assert lengths == {
        "pixel_values": [8, 0, 12, 4],
        "image_grid_thw": [1, 0, 2, 1],
        "pixel_values_videos": [0, 0, 8, 0],
        "video_grid_thw": [0, 0, 1, 0],
    }
    batch = llava_batch([1, 0, 2, 1])  # four images for four rows: still packed
    keys = argument_keys(llava(), (), batch)
    found = recognised(llava(), keys, list(batch.values()), [None] * len(keys), 4)
    assert found.rules["pixel_values"].packed.lengths({}).tolist() == [1, 0, 2, 1]


class _Config(nn.Module):
    """A model whose config names image placeholder 90 (in a sub-config)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(text_config={"vocab_size": 100}, image_token_index=90)


def _found(batch: dict[str, torch.Tensor]) -> tuple[dict, list]:
    found = recognised(_Config(), list(batch), list(batch.values()), [None] * len(batch), 4)
    assert found is not None
    return dict(found.items), list(found.rules)


def test_runs_of_placeholders_place_images_of_any_number_of_tokens() -> None:
    ids = torch.randint(3, 80, (4, 30))
    ids[0, 1:6] = 90  # row 0: one image of 5 tokens, row 1: none,
    ids[2, 1:4], ids[2, 5:14] = 90, 90  # row 2: 3 and 9 tokens, row 3: 4 (LlavaNext's sizes)
    ids[3, 2:6] = 90
    batch = {"input_ids": ids, "pixel_values": torch.randn(4, 5, 3, 2, 2)}
    batch["image_sizes"] = torch.tensor([[8, 8], [8, 16], [16, 8], [8, 8]])
    items, packed = _found(batch)
    assert items == {"pixel_values": (1, 0, 2, 1), "image_sizes": (1, 0, 2, 1)}
    assert packed == ["pixel_values", "image_sizes"]


def test_items_padded_per_row_stay_rows() -> None:
    ids = torch.randint(3, 80, (4, 16))
    ids[0, 1:5], ids[2, 1:5], ids[2, 6:10], ids[3, 1:5] = 90, 90, 90, 90
    pixels = torch.randn(4, 2, 3, 8, 8)  # Idefics3: rows x most images a row has x pixels
    items, packed = _found({"input_ids": ids, "pixel_values": pixels})
    assert items == {"pixel_values": (1, 0, 2, 1)} and packed == []


@pytest.mark.parametrize("name", MODELS)
def test_call_and_backward_equal_the_plain_model(name: str) -> None:
    model, plain = model_and_plain(name)
    batch = batch_of(name)
    out, ref = _pipe(model)(**batch), plain(**batch)
    outputs_equal(out, ref, KEYS)
    out.loss.backward()
    ref.loss.backward()
    assert_grads_equal(model, plain)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", MODELS)
def test_step_equals_the_plain_model(name: str, schedule: str) -> None:
    model, plain = model_and_plain(name)
    batch = batch_of(name)
    loss = _pipe(model, schedule=schedule).step(**batch)
    ref = plain(**batch).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_equal(model, plain)


@pytest.mark.parametrize("name", MODELS)
def test_evaluation_equals_the_plain_model(name: str) -> None:
    model, plain = model_and_plain(name)
    model.eval(), plain.eval()
    batch = batch_of(name)
    pipe = _pipe(model)
    with torch.no_grad():
        out, ref = pipe(**batch), plain(**batch)
    outputs_equal(out, ref, KEYS)


def test_a_layout_planned_from_a_multimodal_sample_equals_the_plain_model() -> None:
    model, plain = model_and_plain("llava")
    batch = llava_batch([1, 0, 2, 2])  # the smallest micro-batch, the last row, has two
    pipe = pipepar.wrap(model, sample=batch, devices=["cpu", "cpu"], chunks=4)
    assert pipe.chunks == 4  # the planner ran the model on micro-batches cut as the pipe cuts
    out, ref = pipe(**batch), plain(**batch)
    outputs_equal(out, ref, KEYS)


# -- a whole argument the rows would take in order -------------------------------------------
IMAGE = 1


class ScattersPatches(nn.Module):
    """Each image token of ``input_ids`` takes the next patch of ``pixel_values`` (the patches
    of all rows, one after another); no config says which token is an image's."""

    def __init__(self, how: str = "masked_scatter") -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(16, 8)
        self.vision = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, pixel_values, labels):
        x, image = self.embed(input_ids), input_ids == IMAGE
        if self.how == "masked_scatter":
            x = x.masked_scatter(image.unsqueeze(-1), self.vision(pixel_values))
        else:
            x[image] = self.vision(pixel_values)  # index_put
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _scatter_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    ids[0, 1:3] = IMAGE  # patches: two, none, one, three
    ids[2, 0] = IMAGE
    ids[3, 2:5] = IMAGE
    return {"input_ids": ids, "pixel_values": torch.randn(6, 4), "labels": ids.clone()}


@pytest.mark.parametrize(
    ("how", "call"),
    [("masked_scatter", "forward"), ("masked_scatter", "step"), ("setitem", "step")],
)
def test_a_whole_argument_scattered_into_the_rows_is_refused(how: str, call: str) -> None:
    torch.manual_seed(0)
    model = ScattersPatches(how)
    before = [p.detach().clone() for p in model.parameters()]
    pipe = pipepar.wrap(model, balance=[3, 3], devices=["cpu", "cpu"], chunks=2)
    run = pipe.step if call == "step" else pipe
    with pytest.raises(
        pipepar.BatchCoupled,
        match=rf"{how}\(\) in module ScattersPatches.*'pixel_values'.*"
        r"split_inputs=\{'pixel_values': pipepar\.Packed",
    ):
        run(**_scatter_batch())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_declared_rule_makes_the_same_model_exact() -> None:
    torch.manual_seed(0)
    model = ScattersPatches()
    plain = ScattersPatches()
    plain.load_state_dict(model.state_dict())
    rule = pipepar.Packed(lambda call: (call["input_ids"] == IMAGE).sum(1))
    pipe = pipepar.wrap(
        model,
        balance=[3, 3],
        devices=["cpu", "cpu"],
        chunks=2,
        split_inputs={"pixel_values": rule},
    )
    batch = _scatter_batch()
    torch.testing.assert_close(pipe(**batch)["logits"], plain(**batch)["logits"])
    with torch.no_grad(), pytest.raises(pipepar.BatchCoupled, match="masked_scatter"):
        pipepar.wrap(ScattersPatches(), balance=[3, 3], devices=["cpu", "cpu"], chunks=2)(**batch)
