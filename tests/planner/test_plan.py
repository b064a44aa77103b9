"""The planner: predicted peaks against measured ones, exactness, capacities, the 10.7B stack."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

import models
import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL, make
from pipepar.planner.measure import measure_split, stage_order
from pipepar.planner.plan import Plan, StagePlan, plan
from pipepar.planner.plan_targets import resolve_targets
from pipepar.planner.profile import profile
from pipepar.planner.stage_memory import MemoryModel
from tests._ranks import spawn

CASES = {
    # name: (model, input shape, stages, chunks, checkpoint, schedule, optimizer)
    "params-heavy": (lambda: models.mlp(4, 512), (16, 512), 2, 4, "never", "gpipe", "adam"),
    "params-heavy-sgd": (
        lambda: models.mlp(4, 512),
        (16, 512),
        2,
        4,
        "except_last",
        "gpipe",
        "sgd",
    ),
    "activations": (
        lambda: models.mlp(4, 128, activation=nn.GELU),
        (2048, 128),
        2,
        4,
        "never",
        "gpipe",
        "adam",
    ),
    "recompute": (
        lambda: models.mlp(4, 128, activation=nn.GELU),
        (2048, 128),
        2,
        4,
        "always",
        "gpipe",
        "adam",
    ),
    "1f1b": (
        lambda: models.mlp(4, 128, activation=nn.GELU),
        (2048, 128),
        2,
        8,
        "except_last",
        "1f1b",
        "adamw",
    ),
    "conv": (lambda: models.convnet(16), (16, 3, 32, 32), 2, 4, "never", "gpipe", "sgd-momentum"),
    "conv-1f1b": (lambda: models.convnet(16), (16, 3, 32, 32), 3, 4, "except_last", "1f1b", "adam"),
    "zb-h1": (
        lambda: models.mlp(4, 128, activation=nn.GELU),
        (2048, 128),
        2,
        4,
        "never",
        "zb-h1",
        "adam",
    ),
    "zb-h1-recompute": (
        lambda: models.mlp(4, 128, activation=nn.GELU),
        (2048, 128),
        3,
        4,
        "always",
        "zb-h1",
        "adam",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_predicted_peaks_within_5_percent_of_measured(case: str) -> None:
    build, shape, k, m, ckpt, schedule, optimizer = CASES[case]
    model, x = build(), torch.randn(*shape)
    prof = profile(model, x, device="cpu", optimizer=optimizer)
    # Drop the measured times so the split (by memory) does not depend on timing noise.
    prof = replace(
        prof, layers=[replace(x, forward_ms=None, backward_ms=None) for x in prof.layers]
    )
    p = plan(
        prof, devices=["cpu"] * k, chunks=m, checkpoint=ckpt, schedule=schedule, optimizer=optimizer
    )
    peaks = measure_split(
        model, x, p.balance, chunks=m, optimizer=optimizer, checkpoint=ckpt, schedule=schedule
    )
    for stage, measured in zip(p.stages, peaks, strict=True):
        error = (stage.peak_bytes - measured) / measured
        assert abs(error) < 0.05, (
            f"stage {stage.index}: predicted {stage.peak_bytes}, measured {measured}"
        )


_STAGING = pytest.mark.xfail(
    reason="on the GPU the bias gradient's sum over the profiled batch (2048 rows) allocates a "
    "reduction staging buffer that a micro-batch's (256-512 rows) does not; the profile scales it "
    "to the micro-batch, 0.25-0.5 MiB too high on these 1.5-7 MiB stages (RESULTS, One GPU (H200))",
    strict=False,
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "case",
    [
        "params-heavy",
        pytest.param("activations", marks=_STAGING),
        pytest.param("recompute", marks=_STAGING),
        pytest.param("1f1b", marks=_STAGING),
    ],
)
def test_predicted_peaks_within_10_percent_on_cuda(case: str) -> None:
    build, shape, k, m, ckpt, schedule, optimizer = CASES[case]
    model, x = build().cuda(), torch.randn(*shape, device="cuda")
    p = plan(
        profile(model, x, device="cuda", optimizer=optimizer),
        devices=["cuda:0"] * k,
        chunks=m,
        checkpoint=ckpt,
        schedule=schedule,
        optimizer=optimizer,
        capacity=None,
    )
    peaks = measure_split(
        model, x, p.balance, chunks=m, optimizer=optimizer, checkpoint=ckpt, schedule=schedule
    )
    for stage, measured in zip(p.stages, peaks, strict=True):
        error = (stage.peak_bytes - measured) / measured
        assert abs(error) < 0.10, (
            f"stage {stage.index}: predicted {stage.peak_bytes}, measured {measured}"
        )


def test_stage_order_matches_the_schedules() -> None:
    assert stage_order("gpipe", 3, 2, 1) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 2),
        ("B", 1),
        ("B", 0),
    ]
    order = stage_order("1f1b", 8, 4, 0)
    in_flight, most = 0, 0
    for action, _ in order:
        in_flight += 1 if action == "F" else -1
        most = max(most, in_flight)
    assert most == 4 and sorted(i for a, i in order if a == "B") == list(range(8))


def test_peak_is_the_sum_of_its_parts_and_in_flight_follows_the_schedule() -> None:
    prof = profile(models.mlp(4, 64), torch.randn(64, 64))
    gpipe = plan(prof, devices=4, chunks=8, schedule="gpipe", checkpoint="never")
    one_f = plan(prof, devices=4, chunks=8, schedule="1f1b", checkpoint="never")
    assert [s.in_flight for s in gpipe.stages] == [8, 8, 8, 8]
    assert [s.in_flight for s in one_f.stages] == [4, 3, 2, 1]
    for s in gpipe.stages + one_f.stages:
        parts = s.params_bytes + s.grads_bytes + s.optimizer_bytes + s.activation_bytes
        assert s.peak_bytes == parts + s.transient_bytes and s.transient_bytes >= 0
    assert gpipe.bubble == pytest.approx(3 / 11)
    # Fewer micro-batches in flight -> less activation memory on every stage but the first.
    for a, b in zip(gpipe.stages[1:], one_f.stages[1:]):
        if a.layers == b.layers:
            assert b.activation_bytes < a.activation_bytes


def test_checkpointing_keeps_only_stage_inputs() -> None:
    prof = profile(models.mlp(8, 256, activation=nn.GELU), torch.randn(512, 256))
    never = plan(prof, devices=2, chunks=4, checkpoint="never")
    always = plan(prof, devices=2, chunks=4, checkpoint="always")
    assert never.balance == always.balance == [8, 8]
    order = make("gpipe", 2, 4, n_workers=2)
    figures = MemoryModel(prof, order, checkpoint="never", foreach=[False] * 2).figures(8, 15)
    # A micro-batch kept whole is 9 stored tensors; checkpointed, its input only.
    assert figures.whole == 9 * figures.inputs
    # GPipe peaks in its first backward: 4 micro-batches whole (less what that backward has
    # freed), or 3 inputs and the one recomputed.
    assert 3 * figures.whole < never.stages[1].activation_bytes <= 4 * figures.whole
    recomputed = 3 * figures.inputs + figures.whole
    assert recomputed - figures.whole < always.stages[1].activation_bytes <= recomputed


def _brute_force(model: MemoryModel, targets: list, n: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), len(targets) - 1):
        bounds = [0, *cuts, n]
        peaks = [
            model.stage(j, bounds[j], bounds[j + 1] - 1).peak_bytes for j in range(len(targets))
        ]
        if all(t.capacity is None or p <= t.capacity for p, t in zip(peaks, targets)):
            best = min(best, max(p / t.capacity for p, t in zip(peaks, targets)))
    return best


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_balance_by_memory_is_optimal(schedule: str) -> None:
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 512),
        nn.GELU(),
        nn.Linear(512, 64),
        nn.ReLU(),
        nn.Linear(64, 512),
        nn.Linear(512, 8),
    )
    prof = profile(model, torch.randn(128, 64))
    caps = ["3MiB", "4MiB", "2MiB"]
    p = plan(
        prof, devices=["cuda:0", "cuda:1", "cuda:2"], capacity=caps, chunks=4, schedule=schedule
    )
    targets = resolve_targets(["cuda:0", "cuda:1", "cuda:2"], caps, layers=len(model))
    oracle = MemoryModel(
        prof, make(schedule, 3, 4, n_workers=3), checkpoint="except_last", foreach=[True] * 3
    )
    got = max(s.peak_bytes / s.capacity_bytes for s in p.stages)  # type: ignore[operator]
    assert got == pytest.approx(_brute_force(oracle, targets, len(model)))


def test_balance_by_time_when_measured() -> None:
    prof = profile(models.mlp(4, 32), torch.randn(8, 32))
    times = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0, 6.0]
    timed = replace(
        prof, layers=[replace(x, forward_ms=t, backward_ms=0.0) for x, t in zip(prof.layers, times)]
    )
    p = plan(timed, devices=3, chunks=2)
    assert p.objective == "time"
    assert p.balance == pipepar.partition(times, 3) == [6, 1, 1]
    assert [s.time_ms for s in p.stages] == [6.0, 6.0, 6.0]


def test_heterogeneous_capacities_give_the_big_device_more() -> None:
    prof = profile(models.mlp(4, 256), torch.randn(8, 256))
    even = plan(prof, devices=["cuda:0", "cuda:1"], capacity="100MiB")
    skewed = plan(prof, devices=["cuda:0", "cuda:1"], capacity=["2.2MiB", "100MiB"])
    assert even.balance == [4, 4]
    assert skewed.balance[0] < skewed.balance[1] and skewed.stages[0].fits


def test_a_layer_too_big_for_any_device_is_named() -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 4096), nn.Linear(4096, 8))
    with pytest.raises(
        ValueError, match=r"layer 1 \(Linear\) needs .* on a stage of its own"
    ) as err:
        plan(model, torch.randn(4, 8), devices=2, capacity="1MiB")
    assert "short by" in str(err.value) and "checkpoint='always'" in str(err.value)


def test_no_fitting_split_names_the_stage_and_shortfall() -> None:
    prof = profile(models.mlp(4, 256), torch.randn(8, 256), optimizer="adam")
    need = max(s.peak_bytes for s in plan(prof, devices=2).stages)
    with pytest.raises(
        ValueError, match=r"no balance of 8 layers over 2 devices fits: at best stage \d"
    ) as err:
        plan(prof, devices=2, capacity=int(need * 0.95))
    assert "short by" in str(err.value)


def _plan_10_7b(rank: int) -> dict[str, object]:
    """The 10.7B stack planned in a process of its own (its peak memory is this plan's)."""
    import resource

    model = nn.Sequential(*[nn.Linear(16384, 16384, device="meta") for _ in range(40)])
    plan = pipepar.plan(model, torch.empty(8, 16384, device="meta"), devices=8,
                        capacity="80GiB", optimizer="adam", chunks=8)  # fmt: skip
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss": rss, "balance": plan.balance, "params": plan.profile.total("params_bytes"),
            "peaks": [s.peak_bytes for s in plan.stages]}  # fmt: skip


def test_the_10_7b_stack_plans_in_little_memory() -> None:
    """Planning a 10.7B-parameter stack stays on the meta device (its speed is timed by
    benchmarks/bench_plan.py, not here). It runs in a process forked from the tests' server
    (torch and pipepar imported, no model built): its peak RSS is the server's and the plan's."""
    result = spawn(1, _plan_10_7b)[0]
    assert result["params"] == 40 * (16384 * 16384 + 16384) * 4  # 10.7B parameters
    assert result["balance"] == [5] * 8
    # The weights alone would be 43 GB (each layer 1 GiB): planning keeps them on meta. The
    # process takes ~0.45 GiB before planning (what the fork server imported) and ~0.47 GiB
    # after; a weight made on the CPU would count (checked: 4.2 GiB made there reads 4.6).
    assert result["rss"] < 4 * 2**30
    assert all(p < 80 * 2**30 for p in result["peaks"])


def test_plan_from_a_model_and_a_sample() -> None:
    p = plan(models.mlp(2, 32), torch.randn(4, 32), devices=2, chunks=2, optimizer=None)
    assert isinstance(p, Plan) and isinstance(p.stages[0], StagePlan)
    assert p.profile.device == "meta" and p.profile.optimizer == "none"
    assert p.micro_batch_rows == 2 and sum(p.balance) == 4


def test_wrap_without_balance_uses_the_planner() -> None:
    model = models.mlp(4, 32)
    x = torch.randn(16, 32)
    expected = plan(
        profile(model, x, device="cpu"), devices=["cpu", "cpu"], chunks=4, optimizer=None
    )
    pipe = pipepar.wrap(
        model,
        sample=x,
        devices=["cpu", "cpu"],
        chunks=4,
        schedule="gpipe",
        checkpoint="except_last",
    )  # all fixed: only the balance is planned
    assert sum(pipe.balance) == 8 and len(pipe.balance) == 2
    assert pipe.balance == expected.balance or expected.objective == "time"  # times are noisy


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"schedule": "zigzag"},
            ValueError,
            r"schedule must be one of \['gpipe', '1f1b', 'zb-h1', 'interleaved-1f1b', 'zb-v', "
            r"'v-half', 'v-min'\]",
        ),
        ({"schedule": "zb-v", "devices": 3}, ValueError, "runs 6 stages on 3 devices but"),
        ({"checkpoint": "sometimes"}, ValueError, "checkpoint='sometimes'"),
        ({"chunks": 0}, ValueError, "chunks=0 must be >= 1"),
        ({"chunks": 2.5}, TypeError, "chunks must be an int"),
        ({"devices": 9}, ValueError, "asks for 9 stages but the model has 4 layers"),
        ({"devices": "cuda:0"}, TypeError, "devices must be a count"),
        ({"devices": ["gpu:0"]}, ValueError, r"devices\[0\]='gpu:0' is not a torch device"),
        (
            {"devices": 2, "capacity": ["1GiB"]},
            ValueError,
            "capacity has 1 entries but there are 2",
        ),
        ({"capacity": "lots"}, ValueError, "capacity='lots' is not a byte size"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    prof = profile(models.mlp(2, 8), torch.randn(2, 8))
    with pytest.raises(error, match=match):
        plan(prof, **({"devices": 2} | kwargs))


def test_model_without_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="no sample"):
        plan(models.mlp(2, 8))
    with pytest.raises(TypeError, match=r"nn\.Sequential or a pipepar Profile"):
        plan("model")  # type: ignore[arg-type]


def test_stages_never_start_with_a_layer_that_writes_its_input() -> None:
    model = nn.Sequential(
        *[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU(inplace=True))]
    )
    prof = profile(model, torch.randn(8, 64))
    assert [x.modifies_input for x in prof.layers] == [False, True] * 4
    for k in (2, 3, 4):
        p = plan(prof, devices=k, chunks=2)
        assert all(model[s.layers.start].__class__ is nn.Linear for s in p.stages)
    with pytest.raises(ValueError, match=r"only 4 layers can start one: layers \[1, 3, 5, 7\]"):
        plan(prof, devices=5)


@pytest.mark.parametrize("schedule", NAMES)
def test_stages_hold_what_the_schedule_says(schedule: str) -> None:
    model, x = models.mlp(8, 64), torch.randn(16, 64)
    p = plan(profile(model, x, device="meta"), devices=4, chunks=8, schedule=schedule)
    n = 8 if schedule in VIRTUAL else 4
    expected = make(schedule, n, 8, n_workers=4)
    assert len(p.balance) == n and p.schedule == schedule
    assert [s.in_flight for s in p.stages] == [expected.in_flight(j) for j in range(n)]
    assert [s.worker for s in p.stages] == list(expected.placement)
    assert p.bubble == pytest.approx(expected.bubble())
    if schedule in ("1f1b", "zb-h1"):
        assert [s.in_flight for s in p.stages] == [4, 3, 2, 1]  # K - j
    if schedule == "gpipe":
        assert [s.in_flight for s in p.stages] == [8] * 4  # M


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_activations_at_the_peak_are_the_schedules_micro_batches(schedule: str) -> None:
    # Activations dominate (a wide batch, narrow layers): each stage peaks in a backward.
    prof = profile(models.mlp(4, 32, activation=nn.GELU), torch.randn(4096, 32))
    p = plan(prof, devices=4, chunks=8, schedule=schedule, checkpoint="never")
    order = make(schedule, 4, 8, n_workers=4)
    model = MemoryModel(prof, order, checkpoint="never", foreach=[False] * 4)
    for s in p.stages:
        f = model.figures(s.layers.start, s.layers.stop - 1)
        held = s.in_flight * f.whole + f.batch
        if schedule == "1f1b":  # steady state: K - j micro-batches, gradient sums made
            assert s.in_flight == 4 - s.index and s.activation_bytes == held
        else:  # the first backward: all M, less what it has freed while making gradients
            assert s.in_flight == 8 and held - f.whole < s.activation_bytes <= held


def test_virtual_schedules_plan_two_stages_per_device() -> None:
    prof = profile(models.mlp(8, 64), torch.randn(64, 64), device="meta")
    p = plan(prof, devices=2, chunks=8, schedule="zb-v", capacity="8MiB", checkpoint="never")
    order = make("zb-v", 4, 8, n_workers=2)
    assert len(p.balance) == 4 and sum(p.balance) == 16
    assert [s.worker for s in p.stages] == [0, 1, 1, 0]  # the V: stages w and 2K-1-w
    model = MemoryModel(prof, order, checkpoint="never", foreach=[True, True])
    for w in range(2):
        mine = [s for s in p.stages if s.worker == w]
        ranges = [(s.layers.start, s.layers.stop - 1) for s in mine]
        exact = sum(m.peak_bytes for m in model.device(w, ranges))
        alone = sum(model.stage(s.index, *r).peak_bytes for s, r in zip(mine, ranges))
        # The device's peak is its stages' parts at one moment of its one list: at most the
        # sum of each stage's own peak (their peaks need not coincide), which the search bounds.
        assert all(s.device_peak_bytes == exact for s in mine)
        assert sum(s.peak_bytes for s in mine) == exact <= alone <= 8 * 2**20
        assert all(s.fits and s.capacity_bytes == 8 * 2**20 for s in mine)
    assert p.peak_bytes == max(s.device_peak_bytes for s in p.stages)


def test_a_schedule_object_is_planned_as_given() -> None:
    prof = profile(models.mlp(4, 64), torch.randn(16, 64), device="meta")
    order = make("interleaved-1f1b", 4, 4, n_workers=2)
    p = plan(prof, devices=2, chunks=4, schedule=order)
    assert p.schedule == "interleaved-1f1b" and len(p.balance) == 4
    assert [s.in_flight for s in p.stages] == [order.in_flight(j) for j in range(4)]
    with pytest.raises(ValueError, match="schedule is for 4 stages x 4 micro-batches"):
        plan(prof, devices=2, chunks=8, schedule=order)
