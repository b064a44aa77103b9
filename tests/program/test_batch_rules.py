"""Declared cutting of a call's arguments and joining of its outputs (wrap's ``split_inputs``
and ``join_outputs``): inputs packed over images, custom splits and joins, equal to the plain
model on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from tests.program._packed_toy import IMAGE, PackedImages, packed_batch, patches_per_row


def _pipe(model: nn.Module, **kwargs) -> pipepar.Pipe:
    return pipepar.wrap(
        model, balance=[3, 2, 2], devices=["cpu", "cpu", "cpu"], chunks=4, **kwargs
    )


def _step_equals_plain(pipe: pipepar.Pipe, model: nn.Module, plain: nn.Module, batch) -> None:
    """``pipe.step`` gives the plain model's loss on the whole batch, and its gradients."""
    loss = pipe.step(**batch)
    ref = plain(**batch)["loss"]
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return PackedImages()


def test_packed_inputs_and_outputs_equal_the_plain_model() -> None:
    model, batch = _model(), packed_batch()
    plain = copy.deepcopy(model)
    pipe = _pipe(model, split_inputs={"pixel_values": pipepar.Packed(patches_per_row)})
    out, ref = pipe(**batch), plain(**batch)
    for key in ("logits", "image_hidden_states", "loss"):
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-6)
    out["loss"].backward()
    ref["loss"].backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_packed_step_equals_the_plain_loss(schedule: str) -> None:
    model, batch = _model(), packed_batch()
    plain = copy.deepcopy(model)
    pipe = _pipe(
        model,
        schedule=schedule,
        split_inputs={"pixel_values": pipepar.Packed(patches_per_row)},
    )
    _step_equals_plain(pipe, model, plain, batch)


def test_without_a_rule_the_patches_passed_whole_are_refused() -> None:
    pipe = _pipe(_model())  # every micro-batch would get every patch and take its first ones
    with pytest.raises(pipepar.BatchCoupled, match=r"masked_scatter\(\).*'pixel_values'"):
        pipe(**packed_batch())


def test_custom_split_whole_and_output_joins() -> None:
    model, batch = _model(), packed_batch()
    plain = copy.deepcopy(model)
    scale = torch.tensor(0.5)

    def by_rows(value, pieces):  # the patches of each micro-batch's rows, by hand
        counts = [0, *torch.cumsum(patches_per_row(batch), 0).tolist()]
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
        pipe(**packed_batch())
    pipe = _pipe(_model(), split_inputs={"pixel_values": pipepar.Packed(lambda c: [1, 1, 1, 1])})
    with pytest.raises(ValueError, match="adding up to 4"):
        pipe(**packed_batch())


class _Strict(PackedImages):
    """Checks, as real vision-language models do, that it was given one patch per image
    token."""

    def forward(self, input_ids, pixel_values, labels=None, scale=None):
        tokens = int((input_ids == IMAGE).sum())
        if pixel_values.shape[0] != tokens:
            raise ValueError(f"{pixel_values.shape[0]} patches for {tokens} image tokens")
        return super().forward(input_ids, pixel_values, labels, scale)


def test_planning_cuts_the_sample_by_the_declared_rules() -> None:
    torch.manual_seed(0)
    model, batch = _Strict(), packed_batch()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model,
        sample=batch,
        devices=["cpu", "cpu"],
        chunks=4,
        split_inputs={"pixel_values": pipepar.Packed(patches_per_row)},
    )
    _step_equals_plain(pipe, model, plain, batch)
