"""Every schedule in one process: pipe.step and pipe(x) equal the plain model, memory follows."""

from __future__ import annotations

import copy
import random
import threading
import weakref
from collections import Counter
from typing import ClassVar

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES
from pipepar.core.named_schedules import VIRTUAL as _VIRTUAL
from tests._stacks import WIDTH, random_balance, random_stack

SCHEDULES = list(NAMES)
VIRTUAL = set(_VIRTUAL)
MODES = ["always", "except_last", "never"]


def _balance(schedule: str, rng: random.Random, n_layers: int, devices: int) -> list[int]:
    stages = 2 * devices if schedule in VIRTUAL else devices
    return random_balance(rng, n_layers, stages)


def _plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_step_matches_the_plain_model(schedule: str, checkpoint: str) -> None:
    rng = random.Random(f"{schedule}-{checkpoint}")
    for devices, chunks in ((2, 4), (3, 5)):
        plain = random_stack(rng, 12)
        model = copy.deepcopy(plain)
        pipe = pipepar.wrap(
            model,
            _balance(schedule, rng, 12, devices),
            devices=["cpu"] * devices,
            chunks=chunks,
            schedule=schedule,
            checkpoint=checkpoint,
        )
        x, y = torch.randn(10, WIDTH, requires_grad=True), torch.randn(10, WIDTH)
        x_plain = x.detach().clone().requires_grad_()
        for _ in range(2):  # gradients accumulate over steps like loss.backward()
            loss = pipe.step(x, y, nn.functional.mse_loss)
            ref = _plain_step(plain, x_plain, y)
            torch.testing.assert_close(loss, ref)
        for a, b in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_call_and_backward_match_the_plain_model(schedule: str) -> None:
    rng = random.Random(schedule)
    plain = random_stack(rng, 10)
    model = copy.deepcopy(plain)
    pipe = pipepar.wrap(
        model, _balance(schedule, rng, 10, 2), devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    torch.testing.assert_close(pipe(x), plain(x))
    nn.functional.mse_loss(pipe(x), y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_step_runs_on_the_workers_where_a_calls_backward_takes_the_callers_thread(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA only the backward of ``pipe(...)`` must run on the caller's thread (it runs on the
    autograd engine's device thread, see ``PipeView.workers``); ``pipe.step`` runs its forwards
    and backwards on the stage workers there too. Simulated on the CPU: the pipe answers
    ``workers(backward=True)`` with the caller's thread, and the step still runs every layer's
    forward on a worker and equals the plain model."""
    from pipepar.local.pipe_view import PipeView

    workers = PipeView.workers
    monkeypatch.setattr(
        PipeView, "workers", lambda self, *, backward=False: None if backward else workers(self)
    )
    rng = random.Random(schedule)
    plain = random_stack(rng, 10)
    model = copy.deepcopy(plain)
    threads: set[str] = set()
    for layer in model:
        layer.register_forward_hook(lambda *_: threads.add(threading.current_thread().name))
    pipe = pipepar.wrap(
        model, _balance(schedule, rng, 10, 2), devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    pipe.step(x, y, nn.functional.mse_loss)
    _plain_step(plain, x, y)
    assert threading.current_thread().name not in threads and len(threads) == 2
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


class _Pair(nn.Module):
    """Turns x into (x, 2x), or adds a pair back up: tuples cross stage boundaries."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.split = split
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, v: torch.Tensor | tuple[torch.Tensor, ...]) -> object:
        if self.split:
            h = self.linear(v)  # type: ignore[arg-type]
            return h, 2 * h
        a, b = v  # type: ignore[misc]
        return self.linear(a) + b, b


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tuples_between_stages(schedule: str) -> None:
    plain = nn.Sequential(_Pair(True), _Pair(False), _Pair(False), _Pair(False), _First())
    model = copy.deepcopy(plain)
    balance = [2, 1, 1, 1] if schedule in VIRTUAL else [3, 2]
    pipe = pipepar.wrap(model, balance, devices=["cpu", "cpu"], chunks=3, schedule=schedule)
    x, y = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    loss = pipe.step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, _plain_step(plain, x, y))
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


class _First(nn.Module):
    def forward(self, v: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return v[0]


class _Probe(nn.Module):
    """Counts, per stage, the micro-batches whose saved activations are alive."""

    alive: ClassVar[Counter[int]] = Counter()
    peak: ClassVar[Counter[int]] = Counter()

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(x)  # saved by the product until its graph is freed
        _Probe.alive[self.stage] += 1
        _Probe.peak[self.stage] = max(_Probe.peak[self.stage], _Probe.alive[self.stage])
        weakref.finalize(mask, _Probe.alive.subtract, [self.stage])
        return x * mask


@pytest.mark.parametrize(("schedule", "bound"), [("1f1b", "k-j"), ("zb-h1", "k-j"), ("gpipe", "m")])
def test_step_holds_what_the_schedule_allows(schedule: str, bound: str) -> None:
    k, m = 4, 8
    layers: list[nn.Module] = []
    for j in range(k):
        layers += [nn.Linear(WIDTH, WIDTH), _Probe(j)]
    _Probe.alive.clear(), _Probe.peak.clear()
    pipe = pipepar.wrap(
        nn.Sequential(*layers), [2] * k, devices=["cpu"] * k, chunks=m, schedule=schedule,
        checkpoint="never",
    )  # fmt: skip
    pipe.step(torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH), nn.functional.mse_loss)
    for j in range(k):
        expected = k - j if bound == "k-j" else m
        assert _Probe.peak[j] == min(expected, m), (j, dict(_Probe.peak))
        assert pipe.schedule.in_flight(j) == min(expected, m)
    assert sum(_Probe.alive.values()) == 0  # everything saved was released


@pytest.mark.parametrize("schedule", ["zb-v", "v-half", "v-min"])
def test_a_v_schedule_holds_on_each_device_what_it_allows(schedule: str) -> None:
    """Stage ``w`` and ``2K-1-w`` share device ``w``: the micro-batches alive on a device at
    once are the schedule's worker count, within its bound (v-min: half of zb-v's here, v-half
    3/4)."""
    k, m = 4, 8
    layers: list[nn.Module] = []
    for s in range(2 * k):
        layers += [nn.Linear(WIDTH, WIDTH), _Probe(s if s < k else 2 * k - 1 - s)]
    _Probe.alive.clear(), _Probe.peak.clear()
    pipe = pipepar.wrap(
        nn.Sequential(*layers), [2] * 2 * k, devices=["cpu"] * k, chunks=m, schedule=schedule,
        checkpoint="never",
    )  # fmt: skip
    pipe.step(torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH), nn.functional.mse_loss)
    order = pipe.schedule
    assert order.max_in_flight is not None
    for w in range(k):
        assert _Probe.peak[w] <= order.worker_in_flight(w) <= order.max_in_flight[w]
    assert max(_Probe.peak.values()) == {"zb-v": 2 * k, "v-half": k + 2, "v-min": k}[schedule]
    assert sum(_Probe.alive.values()) == 0


def test_zero_bubble_defers_weight_gradients() -> None:
    pipe = pipepar.wrap(
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]),
        [2, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        schedule="zb-h1",
        trace=True,
    )
    pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH), nn.functional.mse_loss)
    assert pipe.tracer is not None
    weights = [e for e in pipe.tracer.events if e.kind == "weight"]
    assert len(weights) == 2 * 4  # one W per stage and micro-batch, computed apart from B


class _Twice(nn.Module):
    """One Linear applied twice: its weight is reached from two places in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


def test_a_weight_used_twice_in_a_stage_falls_back_to_a_whole_backward() -> None:
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), _Twice())
    model = copy.deepcopy(plain)
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=2, schedule="zb-h1")
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    pipe.step(x, y, nn.functional.mse_loss)
    _plain_step(plain, x, y)
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_step_rejects_bad_arguments_with_a_fix() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target has 3 rows but the input has 4"):
        pipe.step(torch.randn(4, 4), torch.randn(3, 4), nn.functional.mse_loss)
    with pytest.raises(TypeError, match="must return a scalar tensor"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), lambda o, t: o - t)


def test_unknown_schedules_and_balances_that_do_not_fit_are_refused() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with pytest.raises(ValueError, match=r"schedule must be one of \['gpipe', '1f1b'"):
        pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], schedule="zb-h2")
    with pytest.raises(ValueError, match="pass balance with 4 entries"):
        pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], schedule="zb-v")
    with pytest.raises(TypeError, match="schedule must be a name or a pipepar Schedule"):
        pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], schedule=3)  # type: ignore[arg-type]


def test_virtual_stages_share_their_device_worker() -> None:
    pipe = pipepar.wrap(
        nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]),
        [1, 1, 1, 1],
        devices=["cpu", "cpu"],
        chunks=2,
        schedule="zb-v",
    )
    assert pipe.schedule.n_workers == 2
    assert list(pipe.schedule.placement) == [0, 1, 1, 0]
    assert pipe.balance == [1, 1, 1, 1]


class _Boom(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise ArithmeticError("boom")
        return x


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failing_layer_reaches_the_caller_and_the_pipe_runs_again(schedule: str) -> None:
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Boom(), nn.Linear(WIDTH, WIDTH)]
    balance = [1, 1, 1, 1] if schedule in VIRTUAL else [2, 2]
    pipe = pipepar.wrap(nn.Sequential(*layers), balance, devices=["cpu", "cpu"], chunks=4,
                        schedule=schedule)  # fmt: skip
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    _Boom.armed = True
    try:
        with pytest.raises(ArithmeticError, match="boom") as info:
            pipe.step(x, y, nn.functional.mse_loss)
    finally:
        _Boom.armed = False
    assert any("micro-batch 0, forward" in note for note in info.value.__notes__)
    assert pipe.step(x, y, nn.functional.mse_loss) > 0  # nothing left waiting


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_deferred_batch_norm_under_step_tracks_the_whole_mini_batch(schedule: str) -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH), nn.ReLU()
        )

    plain, model = build(), build()
    balance = [1, 1, 1, 1] if schedule in VIRTUAL else [2, 2]
    pipe = pipepar.wrap(model, balance, devices=["cpu", "cpu"], chunks=4, schedule=schedule,
                        deferred_batch_norm=True, checkpoint="always")  # fmt: skip
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    for _ in range(2):
        pipe.step(x, y, nn.functional.mse_loss)
        nn.functional.mse_loss(plain(x), y).backward()
    bn, ref = pipe[1], plain[1]
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2
