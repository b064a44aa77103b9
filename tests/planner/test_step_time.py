"""Step-time predictions against hand-computed timings; cluster presets; FLOP counts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL, gpipe, make, n_workers
from pipepar.core.schedule import timed
from pipepar.planner.cluster import NAMES as CLUSTERS
from pipepar.planner.cluster import Cluster, Link, measure_local
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layer_trace import StorageRecord
from pipepar.planner.predicted_actions import KINDS
from pipepar.planner.profile import LayerProfile, Profile
from pipepar.planner.step_time import predict_step

FREE = Link(bandwidth=1e30, latency=0.0)


def _cluster(
    *, per_node: int = 64, nodes: int = 1, intra: Link = FREE, inter: Link = FREE
) -> Cluster:
    return Cluster(
        name="test",
        device="test device",
        devices_per_node=per_node,
        nodes=nodes,
        memory_bytes=2**40,
        flops=1e12,
        efficiency=1.0,
        intra=intra,
        inter=inter,
    )


def _profile(
    n: int,
    *,
    rows: int,
    f: float = 1.0,
    b: float = 2.0,
    out: int = 0,
    grads: int = 0,
    splits: bool = True,
    timed_: bool = True,
) -> Profile:
    """``n`` equal layers; each takes ``f`` and ``b`` ms per row, forward and backward."""
    layers = [
        LayerProfile(
            index=i,
            name=str(i),
            type_name="Linear",
            output_shape=(rows, 1),
            params_bytes=grads,
            grads_bytes=grads,
            optimizer_bytes=0,
            activation_bytes=0,
            output_bytes=out,
            forward_peak_bytes=0,
            backward_peak_bytes=0,
            forward_ms=f * rows if timed_ else None,
            backward_ms=b * rows if timed_ else None,
            splits_backward=splits,
        )
        for i in range(n)
    ]
    return Profile(layers, "cpu", "none", rows, (rows, 1), 0)


def _predict(prof: Profile, balance: list[int], **options: object):  # type: ignore[no-untyped-def]
    options.setdefault("cluster", _cluster())
    options.setdefault("checkpoint", "never")
    return predict_step(prof, balance, **options)  # type: ignore[arg-type]


# -- the schedule's own timing -----------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 8), (3, 1)])
def test_fill_drain_step_is_m_plus_k_minus_1_slots(schedule: str, k: int, m: int) -> None:
    f, b = 1.0, 2.0  # per micro-batch of one row
    pred = _predict(_profile(k, rows=m, f=f, b=b), [1] * k, schedule=schedule, chunks=m)
    assert pred.step_ms == pytest.approx((m + k - 1) * (f + b))
    assert pred.bubble == pytest.approx((k - 1) / (m + k - 1))
    assert pred.busy_ms == pytest.approx((m * (f + b),) * k)
    assert pred.exposed_allreduce_ms == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_bubble_matches_the_schedules_own_with_equal_stages(name: str) -> None:
    k, m = 2, 4
    stages = 2 * k if name in VIRTUAL else k
    pred = _predict(_profile(stages, rows=m), [1] * stages, schedule=name, chunks=m)
    order = make(name, stages, m, n_workers=n_workers(name, stages))
    assert pred.bubble == pytest.approx(order.bubble())


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_is_timed(name: str) -> None:
    stages = 4
    prof = _profile(stages, rows=8, grads=1 << 20)
    pred = _predict(prof, [1] * stages, schedule=name, chunks=8)
    assert pred.schedule == name
    assert pred.step_ms >= max(pred.busy_ms)
    assert 0 <= pred.bubble < 1
    total = sum(s.busy_ms for s in pred.stages)
    assert total == pytest.approx(sum(pred.busy_ms))
    order = make(name, stages, 8, n_workers=n_workers(name, stages))
    assert len(pred.spans) == sum(len(work) for work in order.actions)


def test_zero_bubble_is_shorter_than_1f1b_when_w_splits() -> None:
    prof = _profile(4, rows=8, grads=1 << 20)
    one = _predict(prof, [1] * 4, schedule="1f1b", chunks=8)
    zb = _predict(prof, [1] * 4, schedule="zb-h1", chunks=8)
    assert zb.step_ms < one.step_ms
    assert sum(zb.busy_ms) == pytest.approx(sum(one.busy_ms))  # the same work, reordered
    assert zb.stages[1].weight_ms == pytest.approx(zb.stages[1].input_grad_ms)  # share 0.5
    assert zb.stages[0].input_grad_ms == 0.0  # the first stage's input needs no gradient
    assert zb.stages[0].weight_ms == pytest.approx(2.0 * 8)
    assert one.stages[1].weight_ms == 0.0


def test_weight_share_and_layers_that_cannot_split() -> None:
    prof = _profile(2, rows=4, grads=1 << 20)
    pred = _predict(prof, [1, 1], schedule="zb-h1", chunks=4, weight_share=0.25)
    assert pred.stages[1].weight_ms == pytest.approx(0.25 * 2.0 * 4)
    whole = _predict(_profile(2, rows=4, grads=1, splits=False), [1, 1], schedule="zb-h1", chunks=4)
    assert whole.stages[1].weight_ms == 0.0
    assert whole.stages[1].input_grad_ms == pytest.approx(2.0 * 4)
    frozen = _predict(_profile(2, rows=4, grads=0), [1, 1], schedule="zb-h1", chunks=4)
    assert frozen.stages[1].weight_ms == 0.0  # no trained parameters: nothing for W


# -- micro-batches and recompute ---------------------------------------------------------------
def test_micro_batches_scale_with_their_rows() -> None:
    prof = _profile(2, rows=10, f=1.0, b=2.0)  # 10 rows into 4 micro-batches: 3, 3, 2, 2
    pred = _predict(prof, [1, 1], schedule="gpipe", chunks=4)
    forwards = [end - start for a, start, end in pred.spans if a.stage == 0 and a.kind == "F"]
    assert forwards == pytest.approx([3.0, 3.0, 2.0, 2.0])
    assert pred.stages[0].forward_ms == pytest.approx(10.0)  # the whole batch's
    assert _predict(prof, [1, 1], chunks=64).chunks == 10  # at most one row each


def test_recompute_adds_a_forward_to_each_checkpointed_backward() -> None:
    k, m, f, b = 2, 4, 1.0, 2.0
    prof = _profile(k, rows=m, f=f, b=b)
    always = _predict(prof, [1] * k, schedule="gpipe", chunks=m, checkpoint="always")
    assert always.step_ms == pytest.approx((m + k - 1) * (f + b + f))
    assert always.stages[0].recompute_ms == pytest.approx(m * f)
    assert always.stages[0].input_grad_ms == pytest.approx(m * b)
    last = _predict(prof, [1] * k, schedule="gpipe", chunks=m, checkpoint="except_last")
    assert last.stages[1].recompute_ms == pytest.approx((m - 1) * f)
    never = _predict(prof, [1] * k, schedule="gpipe", chunks=m, checkpoint="never")
    assert never.step_ms < last.step_ms < always.step_ms


# -- transfers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("across", [False, True])
def test_transfer_is_added_at_each_crossing(across: bool) -> None:
    slow = Link(bandwidth=1e6, latency=0.5e-3)  # 1000 B: 1 ms + 0.5 ms
    cluster = (
        _cluster(per_node=1, nodes=2, inter=slow) if across else _cluster(per_node=2, intra=slow)
    )
    prof = _profile(2, rows=1, f=1.0, b=2.0, out=1000)
    pred = _predict(prof, [1, 1], schedule="gpipe", chunks=1, cluster=cluster)
    t = 1.5
    assert pred.step_ms == pytest.approx(1.0 + t + 1.0 + 2.0 + t + 2.0)
    assert pred.stages[0].transfer_ms == pytest.approx(2 * t)
    assert pred.stages[1].transfer_ms == 0.0
    other = (
        _cluster(per_node=2, inter=slow) if across else _cluster(per_node=1, nodes=2, intra=slow)
    )
    assert _predict(prof, [1, 1], schedule="gpipe", chunks=1, cluster=other).step_ms == 6.0


def test_transfer_bytes_come_from_the_storages_crossing_the_cut() -> None:
    prof = _profile(3, rows=1, out=999)
    records = [
        StorageRecord(creator=-1, nbytes=100, last_output=2),  # the sample, carried on: no grad
        StorageRecord(creator=0, nbytes=40, last_output=0),  # layer 0's output
        StorageRecord(creator=0, nbytes=7, saved=True),  # kept for backward, never sent
    ]
    prof = Profile(prof.layers, "cpu", "none", 1, (1, 1), 0, storages=records)
    link = Link(bandwidth=1e3, latency=0.0)  # 1 byte per ms
    pred = _predict(prof, [1, 2], schedule="gpipe", chunks=1, cluster=_cluster(intra=link))
    assert pred.stages[0].transfer_ms == pytest.approx(140 + 40)


def test_virtual_stages_on_one_worker_move_nothing() -> None:
    link = Link(bandwidth=1e3, latency=1e-3)
    prof = _profile(4, rows=4, out=1000)
    pred = _predict(prof, [1] * 4, schedule="zb-v", chunks=4, cluster=_cluster(intra=link))
    assert pred.stages[1].worker == pred.stages[2].worker
    assert pred.stages[1].transfer_ms == 0.0
    assert pred.stages[0].transfer_ms > 0


def test_timed_transfer_delays_the_receiver_only() -> None:
    order = gpipe(2, 2)
    plain = timed(order, lambda a, split: 1.0)
    assert timed(order, lambda a, split: 1.0, transfer=None) == plain
    late = timed(order, lambda a, split: 1.0, transfer=lambda d, a: 0.5 * (d.stage != a.stage))
    assert max(late.values()) == 7.0
    assert late[order.actions[0][0]] == plain[order.actions[0][0]] == 1.0


# -- data parallelism --------------------------------------------------------------------------
def test_dp_ring_all_reduce_after_the_last_backward() -> None:
    k, m, grads = 2, 2, 10**6  # per stage; 1 MB at 1 GB/s = 1 ms
    link = Link(bandwidth=1e9, latency=0.0)
    cluster = _cluster(per_node=2, nodes=2, inter=link)  # the replicas on two nodes
    prof = _profile(k, rows=m, grads=grads)
    pred = _predict(prof, [1] * k, schedule="gpipe", chunks=m, dp=2, cluster=cluster)
    ring = 2 * (2 - 1) / 2 * grads / 1e9 * 1e3
    assert pred.stages[0].allreduce_ms == pytest.approx(ring)
    assert pred.pipeline_ms == pytest.approx((m + k - 1) * 3.0)
    # Stage 0 ends last; stage 1's all-reduce runs while stage 0 still computes.
    assert pred.step_ms == pytest.approx(pred.pipeline_ms + ring)
    assert pred.exposed_allreduce_ms == pytest.approx(ring)
    four = _predict(
        prof,
        [1] * k,
        schedule="gpipe",
        chunks=m,
        dp=4,
        cluster=_cluster(per_node=8, intra=Link(bandwidth=1e9, latency=1e-3)),
    )
    assert four.stages[0].allreduce_ms == pytest.approx(2 * 3 / 4 * 1.0 + 2 * 3 * 1.0)
    assert _predict(prof, [1] * k, chunks=m).stages[0].allreduce_ms == 0.0


# -- FLOP estimates ----------------------------------------------------------------------------
def test_count_flops_of_linear_layers() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(16, 64)
    prof = pipepar.profile(model, x)
    flops = count_flops(model, x, prof)
    first, second = 2 * 16 * 64 * 32, 2 * 16 * 32 * 8
    assert flops == [(first, first), (0.0, 0.0), (second, 2 * second)]  # layer 0: no input grad
    cluster = _cluster()  # 1e12 FLOP/s
    pred = predict_step(prof, [2, 1], cluster=cluster, flops=flops, chunks=1, checkpoint="never")
    assert pred.source == "flops"
    assert pred.stages[0].forward_ms == pytest.approx(first / 1e12 * 1e3)
    assert pred.stages[1].input_grad_ms == pytest.approx(2 * second / 1e12 * 1e3)


def test_meta_profile_needs_flops() -> None:
    with pytest.raises(ValueError, match=r"no layer times.*flops="):
        _predict(_profile(2, rows=2, timed_=False), [1, 1])
    with pytest.raises(ValueError, match="flops has 1 entries but the profile has 2"):
        _predict(_profile(2, rows=2, timed_=False), [1, 1], flops=[(1.0, 2.0)])
    with pytest.raises(ValueError, match=r"flops\[1\]"):
        _predict(_profile(2, rows=2), [1, 1], flops=[(1.0, 2.0), (math.nan, 1.0)])


# -- arguments ---------------------------------------------------------------------------------
def test_argument_errors_say_how_to_fix() -> None:
    prof = _profile(4, rows=4)
    with pytest.raises(ValueError, match="sums to 3 but the model has 4"):
        _predict(prof, [1, 2])
    with pytest.raises(ValueError, match=r"need 8 devices.*nodes=2"):
        _predict(prof, [2, 2], dp=4, cluster=_cluster(per_node=4))
    with pytest.raises(ValueError, match="dp must be"):
        _predict(prof, [2, 2], dp=0)
    with pytest.raises(ValueError, match="weight_share"):
        _predict(prof, [2, 2], weight_share=1.5)
    with pytest.raises(ValueError, match="checkpoint"):
        _predict(prof, [2, 2], checkpoint="sometimes")
    with pytest.raises(TypeError, match="cluster must be"):
        _predict(prof, [2, 2], cluster=8)
    with pytest.raises(ValueError, match="no cluster preset named 'tpu'"):
        _predict(prof, [2, 2], cluster="tpu")


# -- clusters ----------------------------------------------------------------------------------
def test_presets_and_named_lookup() -> None:
    assert set(CLUSTERS) >= {"h100x8", "a100x8", "h200x8", "cpu"}
    for name in CLUSTERS:
        c = Cluster.named(name)
        assert c.name == name and c.nodes == 1 and c.devices == c.devices_per_node
        assert c.inter.bandwidth <= c.intra.bandwidth
    h100 = Cluster.named("h100x8", nodes=4)
    assert (h100.devices, h100.flops, h100.intra.bandwidth) == (32, 989e12, 450e9)
    assert h100.inter.bandwidth == 50e9  # 400 Gb/s
    assert h100.link(3, 4) is h100.intra and h100.link(7, 8) is h100.inter
    assert h100.ring([0, 5]) is h100.intra and h100.ring([1, 9, 17]) is h100.inter
    assert Cluster.named("a100x8").flops == 312e12
    assert predict_step(_profile(2, rows=2), [1, 1], cluster="h100x8").cluster == "h100x8"


def test_unknown_cluster_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no cluster preset named 'v100'") as info:
        Cluster.named("v100")
    assert all(name in str(info.value) for name in CLUSTERS)


def test_cluster_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth=0.0, latency=0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(bandwidth=1.0, latency=-1.0)
    with pytest.raises(ValueError, match="devices_per_node"):
        _cluster(per_node=0)
    with pytest.raises(ValueError, match="efficiency"):
        Cluster(**{**_cluster().__dict__, "efficiency": 2.0})


def test_measure_local_returns_positive_finite_figures() -> None:
    c = measure_local(seconds=0.3)
    for value in (c.flops, c.intra.bandwidth, c.intra.latency, c.memory_bytes):
        assert math.isfinite(value) and value > 0
    assert c.devices_per_node >= 1
    with pytest.raises(ValueError, match="seconds"):
        measure_local(seconds=0)


def test_count_flops_of_any_model_on_meta() -> None:
    pytest.importorskip("transformers")
    from models import transformers_zoo as zoo
    from pipepar.planner.model_profile import profile_model

    model, sample = zoo.gpt2(layers=2, hidden=64), zoo.sample("gpt2", batch=4, seq=16)
    prof = profile_model(model, sample, device="meta")
    flops = count_flops(model, sample, prof)
    names = [layer.name for layer in prof.layers]
    blocks = [flops[names.index(f"transformer.h.{i}")] for i in range(2)]
    tokens, hidden = 4 * 16, 64
    matmuls = 2 * tokens * 12 * hidden * hidden  # qkv, projection, 4x MLP up and down
    attention = 2 * 2 * 4 * 16 * 16 * hidden  # scores and their product with the values
    assert blocks[0] == blocks[1]
    assert blocks[0][0] == pytest.approx(matmuls + attention)
    assert blocks[0][1] == pytest.approx(2 * blocks[0][0], rel=0.1)
    pred = predict_step(prof, [4, len(names) - 4], cluster="h100x8", flops=flops, chunks=4)
    assert pred.source == "flops" and pred.step_ms > 0


# -- sharded data parallelism ------------------------------------------------------------------
def _two_nodes(link: Link) -> Cluster:
    """Two nodes of two devices: the replicas of each pipeline position on different nodes."""
    return _cluster(per_node=2, nodes=2, inter=link)


def _with_params(prof: Profile, per_layer: list[int]) -> Profile:
    """``prof`` with each layer's weights and gradients of the bytes given."""
    layers = [replace(x, params_bytes=n, grads_bytes=n) for x, n in zip(prof.layers, per_layer)]
    return replace(prof, layers=layers)


def test_sharded_step_gathers_first_and_reduce_scatters_last() -> None:
    """GPipe, K=2, M=2, F=1 and B=2 ms, 1 MB of weights and gradients per stage over a 1 GB/s
    link: each worker gathers for (2-1)/2 * 1 ms before its first action, every action runs
    0.5 ms later, and stage 0's reduce-scatter (half the all-reduce) ends the step."""
    k, m, nbytes = 2, 2, 10**6
    cluster = _two_nodes(Link(bandwidth=1e9, latency=0.0))
    prof = _profile(k, rows=m, grads=nbytes)
    options = dict(schedule="gpipe", chunks=m, dp=2, cluster=cluster)
    whole = _predict(prof, [1] * k, **options)
    pred = _predict(prof, [1] * k, **options, dp_shard=True)
    assert pred.dp_shard and not whole.dp_shard and whole.gather_ms == (0.0, 0.0)
    assert pred.gather_ms == pytest.approx((0.5, 0.5))
    assert pred.stages[0].allreduce_ms == pytest.approx(0.5) == whole.stages[0].allreduce_ms / 2
    assert whole.pipeline_ms == pytest.approx((m + k - 1) * 3.0)
    assert pred.pipeline_ms == pytest.approx(whole.pipeline_ms + 0.5)
    assert pred.step_ms == pytest.approx(pred.pipeline_ms + 0.5)
    assert pred.exposed_allreduce_ms == pytest.approx(0.5)
    shifted = [(a, t0 + 0.5, t1 + 0.5) for a, t0, t1 in whole.spans]
    assert [a for a, *_ in pred.spans] == [a for a, *_ in shifted]
    assert [x for _, *t in pred.spans for x in t] == pytest.approx(
        [x for _, *t in shifted for x in t]
    )


def test_gather_and_reduce_scatter_latency_terms() -> None:
    """dp=4 in one node, 1 MB at 1 GB/s with 1 ms per message: (n-1)/n * 1 ms + (n-1) * 1 ms
    each, against the all-reduce's 2 (n-1)/n * 1 ms + 2 (n-1) * 1 ms."""
    prof = _profile(2, rows=2, grads=10**6)
    cluster = _cluster(per_node=8, intra=Link(bandwidth=1e9, latency=1e-3))
    options = dict(schedule="gpipe", chunks=2, dp=4, cluster=cluster)
    pred = _predict(prof, [1, 1], **options, dp_shard=True)
    assert pred.gather_ms == pytest.approx((3 / 4 + 3.0, 3 / 4 + 3.0))
    assert pred.stages[1].allreduce_ms == pytest.approx(3 / 4 + 3.0)
    assert _predict(prof, [1, 1], **options).stages[1].allreduce_ms == pytest.approx(7.5)


def test_a_later_workers_gather_overlaps_its_wait() -> None:
    """Worker 1 waits 1 ms for its first input anyway: a gather of up to 1 ms costs nothing,
    a longer one delays the whole chain behind it by the difference."""
    cluster = _two_nodes(Link(bandwidth=1e9, latency=0.0))
    base = _profile(2, rows=2)
    whole = _predict(base, [1, 1], schedule="gpipe", chunks=2, dp=2, cluster=cluster)
    for mb, late in ((2, 0.0), (4, 1.0)):  # 2 MB -> a 1 ms gather; 4 MB -> 2 ms
        prof = _with_params(base, [0, mb * 10**6])
        pred = _predict(
            prof, [1, 1], schedule="gpipe", chunks=2, dp=2, cluster=cluster, dp_shard=True
        )
        assert pred.gather_ms == pytest.approx((0.0, mb / 2))
        assert pred.pipeline_ms == pytest.approx(whole.pipeline_ms + late)
        first = min(t0 for a, t0, _ in pred.spans if a.stage == 1)
        assert first == pytest.approx(1.0 + late)


@pytest.mark.parametrize("name", NAMES)
def test_gated_timing_is_the_schedules_own(name: str) -> None:
    """No gather: the schedule's own timing; the same gather on every worker: all of it that
    much later."""
    k = 2 if name in VIRTUAL else 4
    order = make(name, k * (2 if name in VIRTUAL else 1), 6, n_workers=k)

    def cost(a, split):  # type: ignore[no-untyped-def]
        return {"F": 1.0, "B": 2.0 if split else 3.0, "W": 1.0 if split else 0.0}[a.kind]

    def send(d, a):  # type: ignore[no-untyped-def]
        return 0.25 * (d.stage != a.stage)

    plain = timed(order, cost, transfer=send)
    assert timed(order, cost, transfer=send, start=[0.0] * k) == plain
    late = timed(order, cost, transfer=send, start=[1.5] * k)
    assert late == pytest.approx({a: t + 1.5 for a, t in plain.items()})


def test_actions_are_the_timeline_as_plain_data() -> None:
    """Every F, B, W of the slowest replica as its span, recompute at the start of its B, the
    gathers at the start and the reduce-scatters at the end; the last one ends the step."""
    prof = _profile(4, rows=4, grads=10**6)
    cluster = _two_nodes(Link(bandwidth=1e9, latency=1e-5))
    pred = _predict(
        prof,
        [2, 2],
        schedule="zb-h1",
        chunks=4,
        dp=2,
        cluster=cluster,
        checkpoint="always",
        dp_shard=True,
    )
    kinds = [a.kind for a in pred.actions]
    assert kinds.count("all-gather") == 2 and kinds.count("reduce-scatter") == 2
    assert "all-reduce" not in kinds and kinds.count("recompute") == 2 * 4
    for a in pred.actions:
        assert a.kind in KINDS and a.end_ms >= a.start_ms
        assert set(a.to_dict()) == {"worker", "stage", "kind", "microbatch", "start_ms", "end_ms"}
    compute = [
        (a.stage, a.kind, a.microbatch, a.start_ms, a.end_ms)
        for a in pred.actions
        if a.kind in ("F", "B", "W")
    ]
    spans = [(a.stage, a.kind, a.microbatch, t0, t1) for a, t0, t1 in pred.spans]
    assert sorted(compute) == sorted(spans)
    for r in (a for a in pred.actions if a.kind == "recompute"):
        b = next(
            x
            for x in pred.actions
            if (x.stage, x.kind, x.microbatch) == (r.stage, "B", r.microbatch)
        )
        assert r.start_ms == b.start_ms and r.end_ms <= b.end_ms  # stage 0: B is all recompute
    gathers = [a for a in pred.actions if a.kind == "all-gather"]
    assert [(a.worker, a.stage, a.start_ms) for a in gathers] == [(0, None, 0.0), (1, None, 0.0)]
    assert [a.end_ms for a in gathers] == pytest.approx(list(pred.gather_ms))
    assert max(a.end_ms for a in pred.actions) == pytest.approx(pred.step_ms)
    assert [a.start_ms for a in pred.actions] == sorted(a.start_ms for a in pred.actions)
    replicated = _predict(prof, [2, 2], schedule="zb-h1", chunks=4, dp=2, cluster=cluster)
    assert {a.kind for a in replicated.actions} == {"F", "B", "W", "all-reduce"}
    assert not {a.kind for a in _predict(prof, [2, 2], chunks=4).actions} - {"F", "B", "W"}


def test_sharding_arguments_say_how_to_fix() -> None:
    prof = _profile(2, rows=2, grads=8)
    with pytest.raises(ValueError, match=r"dp_shard=True shards each stage .* but dp=1"):
        _predict(prof, [1, 1], dp_shard=True)
    with pytest.raises(TypeError, match="dp_shard must be True or False, got 'yes'"):
        _predict(prof, [1, 1], dp=2, dp_shard="yes")
    with pytest.raises(ValueError, match=r"already sharded \(profile.shard=2\).*unsharded"):
        _predict(replace(prof, shard=2), [1, 1], dp=2, dp_shard=True)
