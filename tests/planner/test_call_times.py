"""A layer's time per call and per row, fitted from two profiles; scaling a profile by it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import pipepar
from pipepar.planner.call_times import (
    at_share,
    profile_two_sizes,
    smallest_micro_batch,
    with_call_times,
)
from pipepar.planner.plan_inputs import check_profile
from pipepar.planner.profile import LayerProfile, Profile
from pipepar.planner.profile_rows import at_rows


def _profile(rows: int, times: list[tuple[float, float]] | None) -> Profile:
    """Layers timed ``times[i]`` (forward, backward) ms on ``rows`` rows; None: untimed."""
    n = 2 if times is None else len(times)
    layers = [
        LayerProfile(
            index=i,
            name=str(i),
            type_name="Linear",
            output_shape=(rows, 4),
            params_bytes=64,
            grads_bytes=64,
            optimizer_bytes=0,
            activation_bytes=16 * rows,
            output_bytes=16 * rows,
            forward_peak_bytes=0,
            backward_peak_bytes=0,
            forward_ms=None if times is None else times[i][0],
            backward_ms=None if times is None else times[i][1],
        )
        for i in range(n)
    ]
    return Profile(layers, "cpu", "none", rows, (rows, 4), 16 * rows)


def _line(call: float, per_row: float, rows: int) -> float:
    return call + per_row * rows


def test_two_profiles_on_a_line_give_its_intercept_and_every_size_on_it() -> None:
    # layer 0: 2 ms a call + 0.5 ms a row forward, 1 + 1.5 backward; layer 1: no call cost
    def times(rows: int) -> list[tuple[float, float]]:
        return [(_line(2, 0.5, rows), _line(1, 1.5, rows)), (_line(0, 0.25, rows), 3.0 * rows)]

    fitted = with_call_times(_profile(32, times(32)), _profile(4, times(4)))
    first, second = fitted.layers
    assert (first.forward_call_ms, first.backward_call_ms) == pytest.approx((2.0, 1.0))
    assert (second.forward_call_ms, second.backward_call_ms) == pytest.approx((0.0, 0.0))
    for rows in (1, 8, 16, 64):  # interpolated and extrapolated along the line
        scaled = at_rows(fitted, rows).layers
        expected = [t for pair in times(rows) for t in pair]
        assert [t for x in scaled for t in (x.forward_ms, x.backward_ms)] == pytest.approx(expected)


def test_without_call_times_at_rows_scales_times_in_proportion() -> None:
    prof = _profile(8, [(4.0, 8.0)])
    assert at_rows(prof, 2).layers[0].forward_ms == pytest.approx(1.0)
    assert at_share(10.0, 2.0, 0.25) == pytest.approx(4.0)
    assert at_share(10.0, 0.0, 0.25) == pytest.approx(2.5)


def test_a_small_batch_measured_slower_puts_all_of_the_time_per_call() -> None:
    # host noise: 4 rows took longer than 32; the call cost is clipped to the smaller time
    fitted = with_call_times(_profile(32, [(3.0, 6.0)]), _profile(4, [(5.0, 2.0)]))
    layer = fitted.layers[0]
    assert layer.forward_call_ms == pytest.approx(3.0)  # clipped to the whole batch's time
    assert 0.0 <= layer.backward_call_ms <= 2.0
    assert at_rows(fitted, 4).layers[0].forward_ms == pytest.approx(3.0)
    check_profile(fitted)  # still a valid profile


@pytest.mark.parametrize(
    ("small", "match"),
    [
        (_profile(4, None), r"small .* has no layer times"),
        (_profile(32, [(1.0, 1.0)]), "small has 32 rows and profile 32"),
        (_profile(4, [(1.0, 1.0), (1.0, 1.0)]), "profile has layers"),
    ],
)
def test_bad_pairs_are_refused_naming_the_argument(small: Profile, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with_call_times(_profile(32, [(2.0, 2.0)]), small)
    with pytest.raises(ValueError, match=r"profile .* has no layer times"):
        with_call_times(_profile(32, None), _profile(4, [(1.0, 1.0), (1.0, 1.0)]))


def test_a_call_time_above_the_whole_time_is_refused_by_the_planner() -> None:
    prof = _profile(8, [(1.0, 1.0)])
    bad = replace(prof, layers=[replace(prof.layers[0], forward_call_ms=2.0)])
    with pytest.raises(ValueError, match=r"forward_call_ms=2\.0 with forward_ms=1\.0"):
        check_profile(bad)
    with pytest.raises(ValueError, match=r"forward_call_ms=2\.0"):
        pipepar.plan(bad, devices=1, optimizer=None)


@pytest.mark.parametrize(
    "sample",
    [
        torch.arange(20.0).view(10, 2),
        (torch.zeros(10, 2), torch.ones(10)),
        {"input_ids": torch.zeros(10, 3), "flag": True},
    ],
)
def test_the_smallest_micro_batch_keeps_the_samples_form(sample: object) -> None:
    part = smallest_micro_batch(sample, 4)  # 10 rows in 4: 3, 3, 2, 2
    if isinstance(sample, dict):
        assert part["input_ids"].shape == (2, 3) and part["flag"] is True
    elif isinstance(sample, tuple):
        assert [t.shape[0] for t in part] == [2, 2]
    else:
        assert isinstance(part, torch.Tensor)
        assert torch.equal(part, sample[8:])


def test_two_measured_profiles_of_a_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    seen: list[int] = []

    def measure(sample: torch.Tensor) -> Profile:
        seen.append(sample.shape[0])
        return pipepar.profile(model, sample, device="cpu")

    prof = profile_two_sizes(measure, torch.randn(32, 64), 8)
    assert seen == [32, 4]
    assert prof.batch_size == 32
    for layer in prof.layers:
        assert layer.forward_ms is not None and layer.backward_ms is not None
        assert 0.0 <= layer.forward_call_ms <= layer.forward_ms
        assert 0.0 <= layer.backward_call_ms <= layer.backward_ms
    meta = profile_two_sizes(lambda s: pipepar.profile(model, s), torch.randn(32, 64), 8)
    assert not meta.timed and all(x.forward_call_ms == 0.0 for x in meta.layers)


def test_the_step_prediction_charges_each_micro_batch_its_call_time() -> None:
    from pipepar.planner.step_time import predict_step
    from tests.planner.test_step_time import _cluster

    prof = _profile(4, [(4.0, 8.0), (4.0, 8.0)])
    fitted = replace(prof, layers=[replace(x, forward_call_ms=2.0) for x in prof.layers])
    options = {"cluster": _cluster(), "schedule": "gpipe", "chunks": 4, "checkpoint": "never"}
    linear = predict_step(prof, [1, 1], **options)  # type: ignore[arg-type]
    per_call = predict_step(fitted, [1, 1], **options)  # type: ignore[arg-type]
    # fill-drain over 2 stages and 4 micro-batches: 5 slots of one F and one B
    assert linear.step_ms == pytest.approx(5 * (4.0 / 4 + 8.0 / 4))
    assert per_call.step_ms == pytest.approx(5 * ((2.0 + 2.0 / 4) + 8.0 / 4))
    assert per_call.busy_ms == pytest.approx((4 * 4.5, 4 * 4.5))
    # with one micro-batch the call is paid once: the whole batch's time, as measured
    whole = predict_step(fitted, [1, 1], **(options | {"chunks": 1}))  # type: ignore[arg-type]
    assert whole.step_ms == pytest.approx(2 * (4.0 + 8.0))
