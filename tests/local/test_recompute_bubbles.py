"""Recompute in the schedule's bubbles (R actions): the plain model's numbers, R where listed."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.schedule import Action, Schedule, parse, validate

SCHEDULES = [
    ("gpipe", [3, 3]),
    ("1f1b", [3, 3]),
    ("zb-h1", [3, 3]),
    ("interleaved-1f1b", [2, 1, 2, 1]),
    ("zb-v", [2, 1, 2, 1]),
]


def _model(*, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Dropout(dropout),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    )


def _wrap(model: nn.Module, balance: list[int], schedule: object, **kw: object) -> pipepar.Pipe:
    return pipepar.wrap(
        model,
        balance,
        devices=["cpu", "cpu"],
        chunks=4,
        schedule=schedule,  # type: ignore[arg-type]
        batch_coupling="per-micro-batch",
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("schedule", "balance"), SCHEDULES)
def test_bubbles_give_the_plain_models_loss_gradients_and_statistics(
    schedule: str, balance: list[int]
) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = _wrap(model, balance, schedule, checkpoint="always", recompute="bubbles")
    assert any(a.kind == "R" for w in pipe.schedule.actions for a in w)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(2):  # the running statistics count each micro-batch once, step after step
        loss = pipe.step(x, y, nn.functional.mse_loss)
        out = torch.cat([plain(part) for part in x.chunk(4)])  # batch norm per micro-batch
        expected = nn.functional.mse_loss(out, y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for a, b in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        for a, b in zip(pipe.buffers(), plain.buffers()):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("schedule", "balance"), SCHEDULES)
def test_bubbles_replay_dropout_bit_for_bit(schedule: str, balance: list[int]) -> None:
    # Against the same pipe keeping every graph (no recompute): the same random streams, so
    # only a recompute that drew other masks could differ.
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    got = {}
    runs = [("never", "in_place"), ("always", "in_place"), ("always", "bubbles")]
    for checkpoint, recompute in runs:
        pipe = _wrap(
            _model(dropout=0.3), balance, schedule, checkpoint=checkpoint, recompute=recompute
        )
        torch.manual_seed(7)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        got[recompute, checkpoint] = [loss, *(p.grad for p in pipe.parameters())]
    kept = got["in_place", "never"]
    for other in (got["in_place", "always"], got["bubbles", "always"]):
        assert all(torch.equal(a, b) for a, b in zip(kept, other))


def test_r_runs_where_the_schedule_lists_it_not_inside_b() -> None:
    schedule = parse("F0 F1 F2 F3 R3 B3 R2 B2 R1 B1 R0 B0 | F0 F1 F2 R2 F3 R3 B3 B2 R1 R0 B1 B0")
    for recompute, plan in [("bubbles", "1f1b"), ("in_place", schedule)]:
        pipe = _wrap(_model(), [3, 3], plan, checkpoint="always", recompute=recompute, trace=True)
        pipe.step(torch.randn(16, 8), torch.randn(16, 4), nn.functional.mse_loss)
        events = {(e.stage, e.microbatch, e.kind): e for e in pipe.tracer.events}
        for s in range(2):
            for i in range(4):
                rebuilt, backward = events[s, i, "recompute"], events[s, i, "backward"]
                assert rebuilt.end <= backward.start  # an R of its own, ahead of B


def test_one_worker_runs_r_too() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model,
        [6],
        devices=["cpu"],
        chunks=4,
        checkpoint="except_last",
        recompute="bubbles",
        batch_coupling="per-micro-batch",
    )
    assert [str(a) for a in pipe.schedule.worker(0)].count("R") == 0
    assert sum(a.kind == "R" for a in pipe.schedule.worker(0)) == 3  # not the last micro-batch
    x = torch.randn(16, 8)
    pipe(x).sum().backward()
    torch.cat([plain(part) for part in x.chunk(4)]).sum().backward()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_recompute_arguments_fail_before_any_step() -> None:
    with pytest.raises(ValueError, match="recompute must be one of 'in_place', 'bubbles'"):
        _wrap(_model(), [3, 3], "1f1b", recompute="idle")
    with pytest.raises(ValueError, match="checkpoint='never' recomputes none"):
        _wrap(_model(), [3, 3], "1f1b", checkpoint="never", recompute="bubbles")
    with_r = parse("F0 F1 R0 B0 R1 B1 | F0 F1 R0 B0 R1 B1")
    with pytest.raises(ValueError, match="lists 0R1, 1R1 but checkpoint='except_last' keeps"):
        pipepar.wrap(_model(), [3, 3], devices=["cpu", "cpu"], chunks=2, schedule=with_r)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_model_cut_while_it_runs_recomputes_in_the_bubbles_too() -> None:
    # Its units run again in R (tests/program/test_unit_calls.py has real models).
    model = _TwoLayers()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, split=["b"], devices=["cpu", "cpu"], chunks=2, checkpoint="always",
        recompute="bubbles",
    )  # fmt: skip
    assert any(a.kind == "R" for w in pipe.schedule.actions for a in w)
    x = torch.randn(4, 4)
    pipe(x).sum().backward()
    plain(x).sum().backward()
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_recomputes_placed_on_measured_stage_times_keep_the_plain_numbers() -> None:
    # Stages of unequal cost on a V: after the first step the recomputes are placed on the
    # stages' measured times (where they land depends on them); every step still gives the
    # plain model's numbers.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8),
        nn.BatchNorm1d(8), nn.Linear(8, 4),
    )  # fmt: skip
    plain = copy.deepcopy(model)
    pipe = _wrap(model, [3, 2, 1, 1], "zb-v", checkpoint="always", recompute="bubbles")
    first = pipe.schedule
    bound = [first.worker_rebuilt(w) for w in range(2)]
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        validate(pipe.schedule)  # placed again on the times: within the same bound
        assert all(pipe.schedule.worker_rebuilt(w) <= bound[w] for w in range(2))
        expected = nn.functional.mse_loss(torch.cat([plain(p) for p in x.chunk(4)]), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for a, b in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
            a.grad, b.grad = None, None
        for a, b in zip(pipe.buffers(), plain.buffers()):
            torch.testing.assert_close(a, b)


class _Nap(nn.Module):
    """Identity that takes 20 ms: a stage much slower than the others, whatever the load."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x


def _moved(schedule: Schedule) -> int:
    """R listed anywhere but just before their own B."""
    pairs = [p for w in schedule.actions for p in zip(w, (*w[1:], None))]
    return sum(1 for a, b in pairs if a.kind == "R" and b != Action(a.stage, "B", a.microbatch))


def test_after_the_first_step_recomputes_are_placed_on_the_measured_stage_times() -> None:
    # On unit costs no R of this zb-v moves; measured, stage 0 is slow, and its device's
    # other stage (3) idles before each F: R fill those waits.
    layers: list[nn.Module] = [nn.Linear(8, 8), _Nap()]
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.Identity()]
    model = nn.Sequential(*layers)
    plain = copy.deepcopy(model)
    pipe = _wrap(model, [2, 2, 2, 2], "zb-v", checkpoint="always", recompute="bubbles")
    assert _moved(pipe.schedule) == 0
    for _ in range(2):
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, nn.functional.mse_loss(plain(x), y))
    assert _moved(pipe.schedule) > 0
