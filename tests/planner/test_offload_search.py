"""The layout search trades activation offload against recompute and the rest: offload where a
layout does not fit without it, none where it does, and on CPU devices (their memory is the
host's) none unless asked for; the pipe built with the layout's offload trains as the plain
model; the chosen layout's predicted peak follows the one measured with offload; where the
copies cost little, offload beats recomputing, and where they cost much, recomputing wins. And
what the copies add to the predicted step (:mod:`pipepar.planner.offload_time`).

The search's choice is tested on a GPU preset (``Cluster.host`` set) over a profile on meta:
it needs no GPU, as the choice is the planner's arithmetic."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import gpipe
from pipepar.core.offload import MIN_BYTES
from pipepar.core.offload_plan import Offloader, plan_offload
from pipepar.planner.auto_layout import Given, choose_layout
from pipepar.planner.cluster import Cluster, Link, cluster_for
from pipepar.planner.flop_count import count_flops
from pipepar.planner.layout import Layout
from pipepar.planner.measure import measure_device
from pipepar.planner.offload_time import offload_ms
from pipepar.planner.step_time import predict_step

WIDTH, ROWS, M = 128, 2048, 8  # a micro-batch's activation: 256 rows x 128 x 4 B = 128 KiB
FIXED = {"schedule": "gpipe", "chunks": M, "checkpoint": "never"}
CAPACITY = 4_500_000  # gpipe, 8 micro-batches, no recompute on 2 devices: 3.3 MB offloaded,
# 5.7 MB kept (no optimizer state)


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


# -- the search's choice: only on devices with memory of their own ---------------------------
def _choose(cluster: Cluster, offload: bool | None = None, capacity: int = CAPACITY) -> Layout:
    """What pipepar.wrap(sample=...) chooses on two devices of ``cluster``, profiled on meta."""
    x, _ = _batch()
    given = Given(dp=1, offload=offload, **FIXED)  # type: ignore[arg-type]
    return choose_layout(
        _chain(), x, devices=2, given=given, cluster=cluster, capacity=capacity,
        profile_device="meta",
    )  # fmt: skip


def test_where_only_offload_fits_a_gpu_search_offloads() -> None:
    assert ROWS // M * WIDTH * 4 >= MIN_BYTES  # the micro-batches' activations are sent
    gpus = Cluster.named("h100x8")
    with pytest.raises(ValueError, match="no layout fits"):
        _choose(gpus, offload=False)
    layout = _choose(gpus)
    assert layout.offload and "offload" in str(layout)
    assert layout.to_dict()["offload"] is True and max(layout.peak_bytes) <= CAPACITY
    assert not _choose(gpus, capacity=2**30).offload  # what fits without it does not offload


def test_cpu_devices_never_offload_unless_asked() -> None:
    """Their memory is the host's: offload would fit only on paper, so the search leaves it
    out (nothing fits at CAPACITY) and given offload=True prices it."""
    cpus = cluster_for(torch.device("cpu"), 2)
    with pytest.raises(ValueError, match=r"no layout fits.*offload is not tried"):
        _choose(cpus)
    assert _choose(cpus, offload=True).offload
    x, _ = _batch()
    with pytest.raises(ValueError, match="no layout fits"):
        pipepar.wrap(_chain(), sample=x, devices=["cpu", "cpu"], capacity=CAPACITY, **FIXED)
    # every schedule and recompute: layouts that fit only with offload on a GPU, none on the CPU
    search = dict(devices=2, batch=ROWS, capacity=CAPACITY, chunks=[M], top=None, optimizer=None)
    on_gpus = pipepar.search_layouts(_chain(), x, cluster="h100x8", **search)  # type: ignore[arg-type]
    on_cpus = pipepar.search_layouts(_chain(), x, cluster="cpu", **search)  # type: ignore[arg-type]
    assert any(x.offload for x in on_gpus) and not any(x.offload for x in on_cpus)
    asked = pipepar.search_layouts(_chain(), x, cluster="cpu", offloads=(False, True), **search)  # type: ignore[arg-type]
    assert any(x.offload for x in asked)


# -- the wrapped pipe --------------------------------------------------------------------------
def test_where_only_offload_fits_the_pipe_offloads_and_trains_as_the_plain_model(
    offloaders: list[Offloader],
) -> None:
    x, y = _batch()
    with pytest.raises(ValueError, match="no layout fits"):
        pipepar.wrap(
            _chain(), sample=x, devices=["cpu", "cpu"], capacity=CAPACITY, offload=False, **FIXED
        )
    plain = _chain()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), sample=x, devices=["cpu", "cpu"], capacity=CAPACITY, offload=True,
        **FIXED,
    )  # fmt: skip
    layout = pipe.layout
    assert layout.offload and pipe.offload and max(layout.peak_bytes) <= CAPACITY
    loss = pipe.step(x, y, nn.functional.mse_loss)
    assert offloaders[-1].counts().sent > 0  # the pipe did send activations out
    want = nn.functional.mse_loss(plain(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for got, expected in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6)


def test_offload_given_is_kept() -> None:
    x, _ = _batch()
    pipe = pipepar.wrap(
        _chain(), sample=x, devices=["cpu", "cpu"], capacity="1GiB", offload=True, **FIXED
    )
    assert pipe.layout.offload and pipe.offload
    with pytest.raises(TypeError, match="offload"):
        pipepar.wrap(_chain(), sample=x, devices=["cpu", "cpu"], offload="yes", **FIXED)  # type: ignore[arg-type]


# -- the search --------------------------------------------------------------------------------
def test_the_chosen_layouts_peak_follows_the_measured_one() -> None:
    """With Adam's state, as measure_device steps (on the CPU; chosen for a GPU preset, where
    the search offloads, as the memory is the same)."""
    x, _ = _batch()
    model = _chain()
    options = dict(devices=2, batch=ROWS, cluster="h100x8", shards=(False,), top=None)
    fixed = dict(schedules=["gpipe"], chunks=[M], checkpoints=["never"])

    def one_pipeline(capacity: int | str) -> pipepar.Layout:
        found = pipepar.search_layouts(model, x, capacity=capacity, **options, **fixed)  # type: ignore[arg-type]
        return next(x for x in found if x.pp == 2)

    kept = one_pipeline("1GiB")
    capacity = int(0.8 * max(kept.peak_bytes))
    layout = one_pipeline(capacity)
    assert layout.offload and not kept.offload
    for w in range(2):
        got = measure_device(
            model, x, list(layout.balance), device=w, chunks=M, schedule="gpipe", offload=True
        )
        assert layout.peak_bytes[w] == pytest.approx(got, rel=0.02), (w, layout.peak_bytes, got)
        assert got <= capacity


def _trade(host: Link) -> pipepar.Layout:
    x, _ = _batch()
    cluster = replace(Cluster.named("h100x8"), host=host)
    return pipepar.search_layouts(
        _chain(), x, devices=2, batch=ROWS, cluster=cluster, capacity=3_500_000,
        optimizer=None, shards=(False,), chunks=(M,), top=1,
    )[0]  # fmt: skip


def test_fewer_micro_batches_are_tried_where_more_did_not_fit_with_offload() -> None:
    """At 64 micro-batches each one's saved tensors are under MIN_BYTES and stay: nothing
    fits; at 8 they go out and it fits. The search's walk down the counts goes on past 64."""
    assert ROWS // 64 * WIDTH * 4 < MIN_BYTES <= ROWS // M * WIDTH * 4
    x, _ = _batch()
    search = dict(devices=2, batch=ROWS, capacity=CAPACITY, top=None, optimizer=None)
    found = pipepar.search_layouts(
        _chain(), x, cluster="h100x8", chunks=[64, M], schedules=["gpipe"],
        checkpoints=["never"], **search,
    )  # type: ignore[arg-type]  # fmt: skip
    assert found and all(x.chunks == M and x.offload for x in found)


def test_the_search_trades_offload_against_recompute() -> None:
    """At 3.5 MB no layout fits without recomputing or offloading: with free copies offload
    (and no recompute) is fastest; over a slow link, recomputing is."""
    free = _trade(Link(bandwidth=1e18, latency=0.0))
    assert free.offload and free.checkpoint == "never"
    slow = _trade(Link(bandwidth=1e6, latency=0.0))
    assert not slow.offload and slow.checkpoint != "never"
    assert free.step_ms < slow.step_ms


def test_bad_offloads_say_how_to_fix_them() -> None:
    x, _ = _batch()
    with pytest.raises(TypeError, match=r"offloads\[0\]"):
        pipepar.search_layouts(
            _chain(),
            x,
            devices=2,
            batch=ROWS,
            cluster="cpu",
            offloads=("yes",),  # type: ignore[arg-type]
        )


# -- the copies' cost --------------------------------------------------------------------------
def test_a_cpu_copies_on_the_worker_both_ways() -> None:
    order = gpipe(2, 4)
    cluster = replace(Cluster.named("cpu"), memory_bandwidth=1e6)
    extra = offload_ms(order, [1000, 500], checkpoint="never", cost=lambda a: 1.0, cluster=cluster)
    sent = plan_offload(order).sent
    assert sent  # GPipe's first micro-batches wait long for their backward
    want = sum(2 * 2e3 * (1000, 500)[s] / 1e6 for s, _ in sent)  # out and back, 2 B moved each
    assert sum(extra.values()) == pytest.approx(want)
    assert (
        offload_ms(order, [1000, 500], checkpoint="always", cost=lambda a: 1.0, cluster=cluster)
        == {}
    )


def test_a_gpu_copy_costs_what_the_action_beside_it_does_not_hide() -> None:
    order = gpipe(2, 4)
    cluster = replace(Cluster.named("h100x8"), host=Link(bandwidth=1e6, latency=0.0))
    n = len(plan_offload(order).sent)
    # each copy takes 1 ms: beside 0.25 ms actions, 0.75 ms of each shows (out and back)
    short = offload_ms(
        order, [1000, 1000], checkpoint="never", cost=lambda a: 0.25, cluster=cluster
    )
    assert sum(short.values()) == pytest.approx(2 * 0.75 * n)
    assert {a.kind for a in short} == {"F", "B"}
    long = offload_ms(order, [1000, 1000], checkpoint="never", cost=lambda a: 5.0, cluster=cluster)
    assert long == {}


def test_predicted_steps_with_offload() -> None:
    """A free link costs nothing; a slow one lengthens the step."""
    x, _ = _batch()
    prof = pipepar.profile(_chain(), x, device="meta")
    flops = count_flops(_chain(), x, prof)
    base = Cluster.named("h100x8")
    step = {}
    for name, host in (
        ("free", Link(bandwidth=1e18, latency=0.0)),
        ("slow", Link(bandwidth=1e8, latency=0.0)),
    ):
        cluster = replace(base, host=host)
        for offload in (False, True):
            step[name, offload] = predict_step(
                prof, [4, 4], cluster=cluster, schedule="gpipe", chunks=M, checkpoint="never",
                flops=flops, offload=offload,
            ).step_ms  # fmt: skip
    assert step["free", True] == pytest.approx(step["free", False])
    assert step["slow", True] > 2 * step["slow", False]


def test_gpu_presets_copy_over_pcie_and_the_cpu_is_its_own_host() -> None:
    for name in ("h100x8", "h200x8", "a100x8"):
        host = Cluster.named(name).host
        assert host is not None and host.bandwidth == 20e9, name
    assert Cluster.named("cpu").host is None
    assert cluster_for(torch.device("cpu"), 2).host is None
