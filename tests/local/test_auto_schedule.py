"""``wrap(schedule="auto", memory_budget=...)`` in one process: the plain model's numbers at
every budget, the budget kept by the schedule it built, and clear errors."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import one_f_one_b
from pipepar.core.schedule import Schedule
from pipepar.planner.stage_activations import predicted_activations
from tests._foreign_models import NanoGPT, nano_batch
from tests._stacks import WIDTH, random_balance, random_stack


def _held(s: Schedule, weight: list[float]) -> float:
    return max(s.worker_held(w, weight) for w in range(s.n_workers))


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("budget", [1, "50%", 2.5, "100%", None])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_step_matches_the_plain_model_within_the_budget(
    v: int, budget: float | str | None, checkpoint: str
) -> None:
    rng = random.Random(f"{v}-{budget}-{checkpoint}")
    devices, chunks = 3, 6
    plain = random_stack(rng, 12)
    model = copy.deepcopy(plain)
    pipe = pipepar.wrap(
        model,
        random_balance(rng, 12, v * devices),
        devices=["cpu"] * devices,
        chunks=chunks,
        schedule="auto",
        memory_budget=budget,
        checkpoint=checkpoint,
    )
    s = pipe.schedule
    most = {1: 1.0, "50%": 1.5, 2.5: 2.5, "100%": 3.0, None: 3.0}[budget]
    assert s.name == "auto" and s.n_workers == devices and s.n_stages == v * devices
    assert _held(s, [1 / v] * s.n_stages) <= most
    x, y = torch.randn(12, WIDTH, requires_grad=True), torch.randn(12, WIDTH)
    x_plain = x.detach().clone().requires_grad_()
    for _ in range(2):
        loss = pipe.step(x, y, nn.functional.mse_loss)
        ref = nn.functional.mse_loss(plain(x_plain), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach())
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-5, atol=1e-6)
    pipe.close()


def test_a_budget_in_bytes_bounds_the_predicted_activation_peak() -> None:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])
    x = torch.randn(16, WIDTH)
    balance = [2, 2, 2, 2]
    prof = pipepar.profile(model, x, device="meta", optimizer=None)
    ref = max(predicted_activations(prof, one_f_one_b(4, 8), balance, "never"))
    sizes = []
    for share in (1.0, 2.0, 4.0):
        budget = int(share * ref)
        pipe = pipepar.wrap(model, balance, devices=2, chunks=8, schedule="auto",
                            memory_budget=str(budget), sample=x, checkpoint="never")  # fmt: skip
        got = predicted_activations(prof, pipe.schedule, balance, "never")
        assert max(got) <= budget
        sizes.append(max(pipe.schedule.max_in_flight or ()))
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    with pytest.raises(ValueError, match=r"memory_budget=100 bytes .* pass memory_budget >= '"):
        pipepar.wrap(model, balance, devices=2, chunks=8, schedule="auto",
                     memory_budget="100", sample=x, checkpoint="never")  # fmt: skip


def test_a_model_that_is_not_a_chain_runs_auto_too() -> None:
    torch.manual_seed(0)
    plain = NanoGPT(layers=4)
    model = copy.deepcopy(plain)
    idx, targets = nano_batch()
    pipe = pipepar.wrap(model, split=["h.1", "h.2", "h.3"], devices=2, chunks=4,
                        schedule="auto", memory_budget="50%")  # fmt: skip
    assert pipe.schedule.n_stages == 4 and pipe.schedule.n_workers == 2
    loss = pipe.step(idx, targets)  # the model's own loss, as nanoGPT returns it
    ref = plain(idx, targets)[1]
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    pipe.close()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(schedule="1f1b", memory_budget=2), ValueError,
         r"memory_budget=2 bounds schedule='auto', but schedule='1f1b'"),
        (dict(schedule="auto", memory_budget="25%"), ValueError,
         r"memory_budget='25%' is 0.5 micro-batches per device, below .*: 1 .* >= '50%'"),
        (dict(schedule="auto", memory_budget=0.5), ValueError,
         r"memory_budget=0.5 is 0.5 .* memory_budget >= 1$"),
        (dict(schedule="auto", memory_budget="1KiB"), ValueError, r"no sample was given"),
        (dict(schedule="auto", memory_budget="lots"), ValueError, "memory_budget"),
        (dict(schedule="auto", memory_budget=[2]), TypeError, "memory_budget must be a number"),
    ],
)  # fmt: skip
def test_bad_budgets_name_the_argument_and_the_least(
    kwargs: dict, error: type[Exception], match: str
) -> None:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    with pytest.raises(error, match=match):
        pipepar.wrap(model, [2, 2], devices=2, chunks=4, **kwargs)


def test_a_budget_needs_the_stages() -> None:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    with pytest.raises(ValueError, match="memory_budget=2 bounds the order built for stages"):
        pipepar.wrap(model, sample=torch.randn(8, WIDTH), devices=2, schedule="auto",
                     memory_budget=2)  # fmt: skip
    pipe = pipepar.wrap(model, sample=torch.randn(8, WIDTH), devices=2, schedule="auto")
    assert pipe.layout is not None  # searched: the named schedules and the order built
