"""A profile scaled to other rows against a profile taken at those rows."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

import models
import pipepar
from models import transformers_zoo
from pipepar.planner.model_profile import profile_model
from pipepar.planner.profile_rows import at_rows


def test_an_mlp_scaled_is_the_mlp_profiled_at_those_rows() -> None:
    """Every figure of a stack of Linear and ReLU is proportional to the rows: exact."""
    model = models.mlp(depth=3, width=64)
    small = pipepar.profile(model, torch.randn(8, 64))
    large = pipepar.profile(model, torch.randn(32, 64))
    scaled = at_rows(small, 32)
    assert [asdict(x) for x in scaled.layers] == [asdict(x) for x in large.layers]
    assert (scaled.batch_size, scaled.input_shape, scaled.input_bytes) == (32, (32, 64), 8192)
    assert sorted((s.creator, s.nbytes) for s in scaled.storages) == sorted(
        (s.creator, s.nbytes) for s in large.storages
    )
    assert at_rows(large, 8).layers[0].activation_bytes == small.layers[0].activation_bytes


def test_times_scale_and_parameters_stay() -> None:
    model = models.mlp(depth=1, width=64)
    prof = pipepar.profile(model, torch.randn(8, 64), device="cpu")
    scaled = at_rows(prof, 24)
    for x, y in zip(prof.layers, scaled.layers):
        assert y.forward_ms == pytest.approx(3 * x.forward_ms)  # type: ignore[operator]
        assert (y.params_bytes, y.grads_bytes, y.optimizer_bytes) == (
            x.params_bytes, x.grads_bytes, x.optimizer_bytes,
        )
        assert [g for _, g in y.backward_points] == [g for _, g in x.backward_points]
    assert at_rows(prof, 8) is prof


def test_a_transformer_keeps_its_shapes() -> None:
    """Nested output shapes get the new rows where they had the old ones."""
    model = transformers_zoo.gpt2(layers=1, device="meta")
    ids = torch.zeros(2, 8, dtype=torch.long)
    prof = profile_model(model, dict(input_ids=ids, labels=ids), device="meta")
    scaled = at_rows(prof, 6)
    assert scaled.input_shape == ((6, 8), (6, 8))
    assert prof.layers[0].output_shape == ((2, 8, 32),)
    assert scaled.layers[0].output_shape == ((6, 8, 32),)


@pytest.mark.parametrize("rows", [0, -1, 2.5, True])
def test_rows_must_be_a_positive_int(rows: object) -> None:
    prof = pipepar.profile(models.mlp(depth=1, width=8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="must be an int >= 1"):
        at_rows(prof, rows)  # type: ignore[arg-type]
