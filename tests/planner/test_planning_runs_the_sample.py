"""Planning runs only what the plain model runs, and leaves the model as it was.

A training-mode batch norm fails on one row ("Expected more than 1 value per channel"), so a
probe of one row through a ResNet that the plain model never runs would stop planning; and a
profile's forward must not move running statistics or random generators.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import pipepar
from pipepar.planner.call_times import profile_for_chunks


class _PooledNorm(nn.Module):
    """A convolution, global pooling and a batch norm of the pooled features: one value per
    channel and row, so in training it fails on a single row."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.norm(self.pool(self.conv(x)))))


def _rows_seen(model: nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    seen: list[int] = []

    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        x = args[0]
        assert isinstance(x, torch.Tensor)
        seen.append(x.shape[0])

    return seen, model.register_forward_pre_hook(hook)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert list(before) == list(after)
    for key, value in before.items():
        assert torch.equal(value, after[key].cpu()), key


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_finding_units_and_profiling_run_the_sample_as_it_is(name: str) -> None:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10).train()
    x = torch.randn(4, 3, 32, 32)
    model(x)  # the plain model runs on the sample
    before, rng = _state(model), torch.get_rng_state()
    seen, hook = _rows_seen(model)
    assert len(pipepar.units(model, x)) > 2
    prof = pipepar.profile(model, x, device="meta")
    hook.remove()
    assert prof.batch_size == 4 and set(seen) == {4}
    _assert_same(before, _state(model))
    assert torch.equal(rng, torch.get_rng_state())


def test_a_searched_layout_runs_the_sample_and_its_micro_batches_only() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(4, 3, 32, 32)
    before, rng = _state(model), torch.get_rng_state()
    seen, hook = _rows_seen(model)
    pipe = pipepar.wrap(model, sample=x, devices=["cpu", "cpu"], chunks=2)
    hook.remove()
    assert set(seen) == {4, 2} and pipe.chunks == 2
    _assert_same(before, _state(pipe))
    assert torch.equal(rng, torch.get_rng_state())


def test_planning_leaves_running_statistics_and_random_states_as_they_were() -> None:
    torch.manual_seed(0)
    model = _PooledNorm().train()
    x = torch.randn(8, 3, 6, 6)
    before, rng = _state(model), torch.get_rng_state()
    pipe = pipepar.wrap(model, sample=x, devices=["cpu", "cpu"], chunks=2)
    _assert_same(before, _state(pipe))
    assert int(pipe.state_dict()["norm.num_batches_tracked"]) == 0
    assert torch.equal(rng, torch.get_rng_state())  # the dropout drew from a copy's generator


def test_chunks_that_leave_one_row_per_micro_batch_are_named() -> None:
    model = _PooledNorm().train()
    with pytest.raises(ValueError, match=r"chunks=2 .* 2 rows .* fails on 1 row.*chunks <= 1"):
        pipepar.wrap(model, sample=torch.randn(2, 3, 6, 6), devices=["cpu", "cpu"], chunks=2)


def test_a_search_leaves_out_the_chunks_the_model_fails_on() -> None:
    model = _PooledNorm().train()
    x = torch.randn(4, 3, 6, 6)
    seen, hook = _rows_seen(model)
    prof, runs = profile_for_chunks(
        lambda s: pipepar.profile(model, s, device="cpu"), x, [1, 2, 4, 8]
    )
    hook.remove()
    assert runs == [1, 2] and prof.batch_size == 4
    assert 1 in seen and set(seen) <= {4, 2, 1}  # tried as the pipe would run it, then left out
    pipe = pipepar.wrap(model, sample=x, devices=["cpu", "cpu"])
    assert pipe.chunks in (1, 2)
