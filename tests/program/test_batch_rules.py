"""Declared cutting of a call's arguments and joining of its outputs (wrap's ``split_inputs``
and ``join_outputs``): inputs packed over images, custom splits and joins, equal to the plain
model on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar

IMAGE = 1  # the token that stands for one patch of an image


class PackedImages(nn.Module):
    """A toy multimodal model: ``pixel_values`` holds the patches of all images of the batch
    one after another; each image token of ``input_ids`` takes the next patch's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.vision = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, pixel_values, labels=None, scale=None):
        x = self.embed(input_ids)
        image = self.vision(pixel_values)
        x = x.masked_scatter((input_ids == IMAGE).unsqueeze(-1), image)
        if scale is not None:
            x = x * scale
        for block in self.blocks:
            x = x + torch.relu(block(x))
        logits = self.head(x)
        out = {"logits": logits, "image_hidden_states": image}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def _batch(rows: int = 4, seq: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 16, (rows, seq), generator=g)
    ids[0, 1:4] = IMAGE  # row 0: three patches, row 1: none, row 2: one, row 3: two
    ids[2, 0] = IMAGE
    ids[3, 2:4] = IMAGE
    labels = ids.clone()
    labels[1, :3] = -100
    patches = int((ids == IMAGE).sum())
    pixels = torch.randn(patches, 4, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def _patches_per_row(call):
    return (call["input_ids"] == IMAGE).sum(1)


def _pipe(model: nn.Module, **kwargs) -> pipepar.Pipe:
    return pipepar.wrap(
        model, balance=[3, 2, 2], devices=["cpu", "cpu", "cpu"], chunks=4, **kwargs
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return PackedImages()


def test_packed_inputs_and_outputs_equal_the_plain_model() -> None:
    model, batch = _model(), _batch()
    plain = copy.deepcopy(model)
    pipe = _pipe(model, split_inputs={"pixel_values": pipepar.Packed(_patches_per_row)})
    out, ref = pipe(**batch), plain(**batch)
    for key in ("logits", "image_hidden_states", "loss"):
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-6)
    out["loss"].backward()
    ref["loss"].backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_packed_step_equals_the_plain_loss(schedule: str) -> None:
    model, batch = _model(), _batch()
    plain = copy.deepcopy(model)
    pipe = _pipe(
        model,
        schedule=schedule,
        split_inputs={"pixel_values": pipepar.Packed(_patches_per_row)},
    )
    loss = pipe.step(**batch)
    ref = plain(**batch)["loss"]
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_without_a_rule_the_patches_passed_whole_are_refused() -> None:
    pipe = _pipe(_model())  # every micro-batch would get every patch and take its first ones
    with pytest.raises(pipepar.BatchCoupled, match=r"masked_scatter\(\).*'pixel_values'"):
        pipe(**_batch())


def test_custom_split_whole_and_output_joins() -> None:
    model, batch = _model(), _batch()
    plain = copy.deepcopy(model)
    scale = torch.tensor(0.5)

    def by_rows(value, pieces):  # the patches of each micro-batch's rows, by hand
        counts = [0, *torch.cumsum(_patches_per_row(batch), 0).tolist()]
        return [value[counts[p.start] : counts[p.stop]] for p in pieces]

    pipe = _pipe(
        model,
        split_inputs={"pixel_values": by_rows, "scale": "whole"},
        join_outputs={"logits": lambda parts: torch.cat(parts) * 2, "loss": "sum"},
    )
    out = pipe(**batch, scale=scale)
    ref = plain(**batch, scale=scale)
    torch.testing.assert_close(out["logits"], ref["logits"] * 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["image_hidden_states"], ref["image_hidden_states"])
    out["logits"].sum().backward()
    (ref["logits"] * 2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_rules_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"split_inputs\['pixel_values'\] is 'packed'"):
        _pipe(_model(), split_inputs={"pixel_values": "packed"})
    with pytest.raises(ValueError, match=r"join_outputs\['logits'\] is 'mean'"):
        _pipe(_model(), join_outputs={"logits": "mean"})
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        pipepar.wrap(nn.Sequential(nn.Linear(2, 2)), balance=[1], split_inputs={0: "rows"})
    pipe = _pipe(_model(), split_inputs={"pixel_values": pipepar.Packed(lambda c: [1, 2])})
    with pytest.raises(ValueError, match="gave lengths \\[1, 2\\] for a batch of 4 rows"):
        pipe(**_batch())
    pipe = _pipe(_model(), split_inputs={"pixel_values": pipepar.Packed(lambda c: [1, 1, 1, 1])})
    with pytest.raises(ValueError, match="adding up to 4"):
        pipe(**_batch())
