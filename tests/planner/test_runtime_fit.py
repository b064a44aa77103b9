"""The runtime's fit (a scale, times per action and per layer, a recompute factor and time, a
hand-over time) and the gradient sums in step predictions, against hand-computed timings;
fit_runtime recovers known values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipepar.planner.calibrate import Measured, fit_runtime
from pipepar.planner.cluster import Cluster
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.planner.step_time import predict_step
from tests.planner.test_step_time import _cluster, _predict, _profile


# -- what a fit does to a prediction -----------------------------------------------------------
def test_identity_fit_changes_nothing() -> None:
    prof = _profile(4, rows=8, grads=1 << 20)
    for schedule in ("gpipe", "zb-h1", "zb-v"):
        plain = _predict(prof, [1] * 4, schedule=schedule, chunks=8)
        same = _predict(prof, [1] * 4, schedule=schedule, chunks=8, runtime=RuntimeFit())
        assert same.step_ms == pytest.approx(plain.step_ms)


def test_one_stage_step_is_scaled_work_plus_time_per_action() -> None:
    m, f, b, scale, extra = 4, 1.0, 2.0, 1.5, 0.25
    prof = _profile(2, rows=m, f=f, b=b)
    fit = RuntimeFit(scale=scale, action_ms=extra)
    pred = _predict(prof, [2], schedule="gpipe", chunks=m, runtime=fit)
    # one worker: M forwards and M backwards of both layers, one after another
    assert pred.step_ms == pytest.approx(scale * 2 * m * (f + b) + 2 * m * extra)
    assert pred.stages[0].forward_ms == pytest.approx(scale * 2 * m * f + m * extra)


def test_pipeline_slots_grow_by_the_fit() -> None:
    k, m, f, b = 2, 4, 1.0, 2.0
    prof = _profile(k, rows=m, f=f, b=b)
    fit = RuntimeFit(scale=2.0, action_ms=0.5)
    pred = _predict(prof, [1] * k, schedule="gpipe", chunks=m, runtime=fit)
    # the fill-drain shape: (M + K - 1) slots of a forward and of a backward, each fitted
    assert pred.step_ms == pytest.approx((m + k - 1) * (2 * f + 0.5 + 2 * b + 0.5))


def test_weight_actions_take_no_time_per_action() -> None:
    prof = _profile(2, rows=4, grads=1 << 20)
    fit = RuntimeFit(action_ms=1.0)
    pred = _predict(prof, [1, 1], schedule="zb-h1", chunks=4, runtime=fit)
    plain = _predict(prof, [1, 1], schedule="zb-h1", chunks=4)
    assert pred.stages[1].weight_ms == pytest.approx(plain.stages[1].weight_ms)
    assert pred.stages[1].forward_ms == pytest.approx(plain.stages[1].forward_ms + 4)
    assert pred.stages[1].input_grad_ms == pytest.approx(plain.stages[1].input_grad_ms + 4)


def test_recompute_scale_multiplies_the_repeated_forward() -> None:
    k, m, f, b = 2, 4, 1.0, 2.0
    prof = _profile(k, rows=m, f=f, b=b)
    fit = RuntimeFit(recompute_scale=1.5)
    always = _predict(prof, [1] * k, schedule="gpipe", chunks=m, checkpoint="always", runtime=fit)
    assert always.stages[0].recompute_ms == pytest.approx(1.5 * m * f)
    assert always.step_ms == pytest.approx((m + k - 1) * (f + b + 1.5 * f))


def test_time_per_layer_counts_each_action_s_layers() -> None:
    m, f, b, per_layer = 4, 1.0, 2.0, 0.5
    prof = _profile(3, rows=m, f=f, b=b)
    fit = RuntimeFit(layer_ms=per_layer)
    pred = _predict(prof, [3], schedule="gpipe", chunks=m, runtime=fit)
    # one worker, a stage of 3 layers: each of its 2M actions takes 3 x per_layer more
    assert pred.step_ms == pytest.approx(3 * m * (f + b) + 2 * m * 3 * per_layer)
    # four stages of one layer on two workers pay one layer's time per action, not three
    split = _predict(prof, [1, 1, 1], schedule="gpipe", chunks=m, runtime=fit)
    plain = _predict(prof, [1, 1, 1], schedule="gpipe", chunks=m)
    assert split.stages[1].forward_ms == pytest.approx(plain.stages[1].forward_ms + m * per_layer)


def test_recompute_time_is_per_recomputed_layer_and_micro_batch() -> None:
    k, m, f, b, per_layer = 2, 4, 1.0, 2.0, 0.25
    prof = _profile(2 * k, rows=m, f=f, b=b)
    fit = RuntimeFit(recompute_ms=per_layer)
    plain = _predict(prof, [2, 2], schedule="gpipe", chunks=m, checkpoint="always")
    timed = _predict(prof, [2, 2], schedule="gpipe", chunks=m, checkpoint="always", runtime=fit)
    # each stage recomputes its 2 layers for each of the M micro-batches
    assert timed.stages[0].recompute_ms - plain.stages[0].recompute_ms == pytest.approx(
        m * 2 * per_layer
    )
    last = _predict(prof, [2, 2], schedule="gpipe", chunks=m, checkpoint="except_last", runtime=fit)
    assert last.stages[0].recompute_ms == pytest.approx((m - 1) * (2 * f + 2 * per_layer))
    never = _predict(prof, [2, 2], schedule="gpipe", chunks=m, runtime=fit)
    assert never.step_ms == pytest.approx(
        _predict(prof, [2, 2], schedule="gpipe", chunks=m).step_ms
    )


def test_handover_delays_each_crossing_between_workers() -> None:
    k, m, f, b, h = 2, 4, 1.0, 2.0, 0.75
    prof = _profile(k, rows=m, f=f, b=b)
    fit = RuntimeFit(handover_ms=h)
    plain = _predict(prof, [1] * k, schedule="gpipe", chunks=m)
    late = _predict(prof, [1] * k, schedule="gpipe", chunks=m, runtime=fit)
    # the fill-drain critical path crosses once forward and once back
    assert late.step_ms - plain.step_ms == pytest.approx(2 * h)
    one_worker = _predict(prof, [k], schedule="gpipe", chunks=m, runtime=fit)
    assert one_worker.step_ms == pytest.approx(m * k * (f + b))  # nothing crosses


def test_first_stage_w_runs_its_whole_backward_even_where_layers_cannot_split() -> None:
    # the runtime runs a first stage's backward in W whenever its input needs no gradient
    prof = _profile(2, rows=4, grads=1 << 10, splits=False)
    pred = _predict(prof, [1, 1], schedule="zb-h1", chunks=4)
    assert pred.stages[0].input_grad_ms == 0.0
    assert pred.stages[0].weight_ms == pytest.approx(2.0 * 4)
    assert pred.stages[1].weight_ms == 0.0  # a later stage that cannot split runs all in B


# -- gradient sums -----------------------------------------------------------------------------
def _with_memory(bandwidth: float) -> Cluster:
    return replace(_cluster(), memory_bandwidth=bandwidth)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_gradient_sums_cost_each_micro_batch_after_the_first(schedule: str) -> None:
    m, grads, bandwidth = 4, 1_000_000, 1e9  # 3 x 1 MB per sum at 1 GB/s: 3 ms
    prof = _profile(1, rows=m, grads=grads)
    plain = _predict(prof, [1], schedule=schedule, chunks=m)
    summed = _predict(prof, [1], schedule=schedule, chunks=m, cluster=_with_memory(bandwidth))
    assert summed.step_ms - plain.step_ms == pytest.approx((m - 1) * 3e3 * grads / bandwidth)
    frozen = _profile(1, rows=m, grads=0)
    assert _predict(frozen, [1], chunks=m, cluster=_with_memory(bandwidth)).step_ms == (
        pytest.approx(_predict(frozen, [1], chunks=m).step_ms)
    )


def test_weight_gradients_summed_in_their_product_move_less() -> None:
    m, grads, bandwidth = 4, 1_000_000, 1e9
    prof = _profile(1, rows=m, grads=grads)
    direct = replace(prof, layers=[replace(prof.layers[0], direct_grad_bytes=grads)])
    cluster = _with_memory(bandwidth)
    plain = _predict(prof, [1], chunks=m).step_ms
    assert _predict(direct, [1], chunks=m, cluster=cluster).step_ms - plain == pytest.approx(
        (m - 1) * 2e3 * grads / bandwidth
    )


def test_presets_know_their_memory_bandwidth() -> None:
    assert Cluster.named("h100x8").memory_bandwidth == 3.35e12
    assert Cluster.named("a100x8").memory_bandwidth == 2.039e12
    with pytest.raises(ValueError, match="memory_bandwidth"):
        replace(_cluster(), memory_bandwidth=-1.0)


# -- fitting -----------------------------------------------------------------------------------
LAYOUTS = [("1f1b", 4, "never"), ("1f1b", 16, "never"), ("1f1b", 8, "except_last")]


def _measured(prof, truth: RuntimeFit, layouts=LAYOUTS) -> list[Measured]:  # type: ignore[no-untyped-def]
    return [
        Measured([2, 2], s, m, k, _predict(prof, [2, 2], schedule=s, chunks=m, checkpoint=k,
                                           runtime=truth).step_ms)
        for s, m, k in layouts
    ]  # fmt: skip


def test_fit_recovers_the_values_that_made_the_steps() -> None:
    prof = _profile(4, rows=16, f=1.0, b=2.0, grads=1 << 16)
    truth = RuntimeFit(scale=1.3, action_ms=0.7, recompute_scale=1.4)
    fit = fit_runtime(prof, _measured(prof, truth), cluster=_cluster())
    assert fit.scale == pytest.approx(truth.scale, rel=0.02)
    assert fit.action_ms == pytest.approx(truth.action_ms, rel=0.05)
    assert fit.recompute_scale == pytest.approx(truth.recompute_scale, rel=0.02)
    assert fit.fitted_to == 3 and fit.worst_error < 0.01
    # and it predicts a layout it was not fitted to
    other = _predict(prof, [1] * 4, schedule="zb-v", chunks=8, checkpoint="except_last")
    fitted = predict_step(prof, [1] * 4, cluster=_cluster(), schedule="zb-v", chunks=8,
                          checkpoint="except_last", runtime=fit)  # fmt: skip
    truly = _predict(prof, [1] * 4, schedule="zb-v", chunks=8, checkpoint="except_last",
                     runtime=truth)  # fmt: skip
    assert fitted.step_ms == pytest.approx(truly.step_ms, rel=0.02)
    assert other.step_ms < truly.step_ms


def test_fit_recovers_a_handover_from_two_schedules() -> None:
    prof = _profile(4, rows=16, f=1.0, b=2.0, grads=1 << 16)
    truth = RuntimeFit(scale=1.1, action_ms=0.3, handover_ms=0.8)
    layouts = [("1f1b", 4, "never"), ("1f1b", 16, "never"), ("gpipe", 8, "never")]
    fit = fit_runtime(prof, _measured(prof, truth, layouts), cluster=_cluster())
    assert fit.handover_ms == pytest.approx(truth.handover_ms, rel=0.1)
    assert fit.worst_error < 0.01


def test_fit_recovers_per_layer_and_recompute_times() -> None:
    prof = _profile(4, rows=16, f=1.0, b=2.0, grads=1 << 16)
    truth = RuntimeFit(scale=1.2, action_ms=0.4, layer_ms=0.3, recompute_scale=1.3,
                       recompute_ms=0.6)  # fmt: skip
    layouts = [*LAYOUTS, ("1f1b", 16, "except_last"), ("interleaved-1f1b", 8, "never")]
    runs = [
        Measured([1] * 4 if s == "interleaved-1f1b" else [2, 2], s, m, k,
                 _predict(prof, [1] * 4 if s == "interleaved-1f1b" else [2, 2], schedule=s,
                          chunks=m, checkpoint=k, runtime=truth).step_ms)
        for s, m, k in layouts
    ]  # fmt: skip
    fit = fit_runtime(prof, runs, cluster=_cluster())
    assert fit.fitted_to == 5 and fit.worst_error < 0.01
    for name in ("scale", "action_ms", "layer_ms", "recompute_scale", "recompute_ms"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.1, abs=0.03), name
    # three stages' layers and one recomputing M cannot separate them: they stay at 0
    alone = fit_runtime(prof, _measured(prof, truth), cluster=_cluster())
    assert alone.layer_ms == 0.0 and alone.recompute_ms == 0.0


def test_fit_only_the_values_named() -> None:
    prof = _profile(4, rows=16, f=1.0, b=2.0)
    truth = RuntimeFit(scale=1.3, action_ms=0.7)
    fit = fit_runtime(prof, _measured(prof, truth), cluster=_cluster(), fitted=["scale"])
    assert fit.action_ms == 0.0 and fit.recompute_scale == 1.0 and fit.scale > 1.3


def test_fit_leaves_what_the_steps_cannot_tell() -> None:
    prof = _profile(4, rows=16)
    truth = RuntimeFit(scale=1.2, action_ms=0.5)
    one_m = [("1f1b", 8, "never"), ("gpipe", 8, "never")]
    fit = fit_runtime(prof, _measured(prof, truth, one_m), cluster=_cluster())
    assert fit.action_ms == 0.0  # one micro-batch count: the time per action is not separable
    assert fit.recompute_scale == 1.0  # nothing recomputed
    assert fit.handover_ms == 0.0  # not separable from the time per action either
    assert fit.worst_error < 0.1


def test_fit_arguments_say_how_to_fix() -> None:
    prof = _profile(2, rows=4)
    with pytest.raises(ValueError, match="measured is empty"):
        fit_runtime(prof, [], cluster=_cluster())
    with pytest.raises(ValueError, match=r"measured\[0\].step_ms"):
        fit_runtime(prof, [Measured([1, 1], "1f1b", 4, "never", 0.0)], cluster=_cluster())
    with pytest.raises(TypeError, match=r"measured\[0\] is a tuple"):
        fit_runtime(prof, [([1, 1], "1f1b", 4, "never", 1.0)], cluster=_cluster())  # type: ignore[list-item]
    runs = [Measured([1, 1], "1f1b", 4, "never", 10.0)]
    with pytest.raises(ValueError, match="names no RuntimeFit value"):
        fit_runtime(prof, runs, cluster=_cluster(), fitted=["speed"])
    with pytest.raises(ValueError, match="names no RuntimeFit value"):
        fit_runtime(prof, runs, cluster=_cluster(), fitted="scale")
    with pytest.raises(ValueError, match=r"RuntimeFit\.scale"):
        RuntimeFit(scale=0.0)
    with pytest.raises(ValueError, match=r"RuntimeFit\.action_ms"):
        RuntimeFit(action_ms=-1.0)
    with pytest.raises(TypeError, match="runtime must be a RuntimeFit"):
        _predict(prof, [1, 1], runtime={"scale": 2.0})


def test_fit_to_dict_is_plain_numbers() -> None:
    fit = RuntimeFit(scale=1.1, action_ms=0.3, recompute_scale=1.2, fitted_to=3)
    assert fit.to_dict() == {
        "scale": 1.1, "action_ms": 0.3, "recompute_scale": 1.2, "handover_ms": 0.0,
        "layer_ms": 0.0, "recompute_ms": 0.0, "fitted_to": 3, "worst_error": 0.0,
    }  # fmt: skip


def test_search_ranks_layouts_with_the_fit() -> None:
    import models
    import pipepar
    from pipepar.planner.layout_search import search_layouts
    from tests.planner._clusters import cluster

    model = models.mlp(depth=3, width=32)
    x = torch.randn(32, 32)
    prof = pipepar.profile(model, x)
    timed = replace(prof, layers=[replace(y, forward_ms=1.0, backward_ms=2.0) for y in prof.layers])
    options = {"devices": 2, "batch": 32, "cluster": cluster(), "capacity": "1GiB", "top": None}
    plain = search_layouts(timed, schedules=["1f1b"], checkpoints=["never"], **options)
    costly = search_layouts(
        timed, schedules=["1f1b"], checkpoints=["never"], runtime=RuntimeFit(action_ms=50.0),
        **options,
    )  # fmt: skip
    assert {(x.pp, x.chunks) for x in plain} == {(x.pp, x.chunks) for x in costly}
    for layout in costly:  # each layout's time is the fitted prediction's
        key = (layout.pp, layout.dp, layout.chunks)
        same = next(y for y in plain if (y.pp, y.dp, y.chunks) == key)
        assert layout.step_ms > same.step_ms
    # a cost per action makes fewer micro-batches win
    assert costly[0].chunks <= plain[0].chunks
    assert costly[0].chunks < max(x.chunks for x in costly)
