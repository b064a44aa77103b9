"""Learned routes: after the first call of a kind, a pipe of any model runs without the cut's
torch-function mode, with the same results as the plain model, and a call that goes another
way is still right."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipepar
from models import transformers_zoo as zoo
from tests.program._real import (
    SPLITS,
    _batch,
    _close,
    _pipe_step,
    _plain_step,
    _same_grads,
    mode_calls,
)

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]


@pytest.mark.parametrize(("name", "schedule"), list(itertools.product(SPLITS, SCHEDULES)))
def test_following_a_route_equals_the_plain_model(name: str, schedule: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    split = SPLITS[name] if schedule in ("interleaved-1f1b", "zb-v") else SPLITS[name][1:2]
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=split, devices=["cpu", "cpu"], chunks=2, schedule=schedule
    )
    for step in range(3):
        batch, y = _batch(name, seed=step % 2)  # the same kind of call each step
        with mode_calls() as ops:
            loss = _pipe_step(pipe, batch, y)
        _close(loss, _plain_step(plain, batch, y), f"loss of step {step}")
        _same_grads(pipe, plain)
        if step > 0:
            assert ops[0] == 0, f"step {step} ran {ops[0]} operations under the mode"
        else:
            assert ops[0] > 0


def test_a_call_of_another_kind_learns_its_own_route() -> None:
    torch.manual_seed(0)
    plain = zoo.gpt2()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["transformer.h.2"], devices=["cpu"] * 2)
    for seq, learns in [(8, True), (8, False), (6, True), (8, False), (6, False)]:
        ids = torch.randint(1, 64, (2, seq))
        with mode_calls() as ops:
            out = pipe(input_ids=ids, labels=ids)
        assert (ops[0] > 0) == learns, (seq, ops[0])
        expected = plain(input_ids=ids, labels=ids)
        _close(out.logits.detach(), expected.logits.detach(), "logits")
        out.loss.backward()
        expected.loss.backward()
        _same_grads(pipe, plain)


class Branching(nn.Module):
    """Skips block 2 when the first input value is positive: a path that depends on data."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for k, block in enumerate(self.blocks):
            if k == 2 and bool(x[0, 0] > 0):
                continue
            h = self.drop(torch.tanh(block(h)))
        return h


class Shortcut(nn.Module):
    """Adds block 0's output to the last one's in its own code (not a unit's argument) when
    the first input value is positive: a value crossing stages only on some calls."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        first = h = torch.tanh(self.blocks[0](x))
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        if bool(x[0, 0] > 0):
            h = h + first
        return h


PER_MICRO_BATCH = {"batch_coupling": "per-micro-batch"}
"""The models below pick their path by the first row (refused as mixing rows unless asked
for); every row of a test's batch takes the same path (:func:`_signed`), so each micro-batch
takes the plain model's."""


def _signed(sign: float) -> Tensor:
    x = torch.randn(4, 8)
    x[:, 0] = sign * x[:, 0].abs()  # every row: each micro-batch takes the same path
    return x


def _steps_leaving_and_rejoining_the_route(pipe: nn.Module, plain: nn.Module) -> None:
    """Steps whose inputs take the model's other path in the middle: each equals the plain
    model's (loss and gradients)."""
    for sign in (-1.0, -1.0, 1.0, 1.0, -1.0):
        x = _signed(sign)
        loss = pipe.step(x, loss_fn=lambda out, t: out.square().mean(), target=x)
        expected = plain(x).square().mean()
        expected.backward()
        _close(loss, expected.detach(), "loss")
        _same_grads(pipe, plain)


@pytest.mark.parametrize("model_class", [Branching, Shortcut])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_call_that_leaves_the_route_is_still_right(
    model_class: Callable[[], nn.Module], schedule: str
) -> None:
    torch.manual_seed(0)
    plain = model_class().eval()  # no dropout: the plain model draws in another order
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["blocks.2"], devices=["cpu"] * 2, chunks=2,
        schedule=schedule, **PER_MICRO_BATCH,
    ).eval()  # fmt: skip
    _steps_leaving_and_rejoining_the_route(pipe, plain)


def test_a_step_run_again_draws_the_same_random_numbers() -> None:
    """A step that left its route runs again from the same random state: the same dropout
    masks, and the same generator state after it, as a pipe that never follows a route."""
    torch.manual_seed(0)
    model = Branching().train()
    following = pipepar.wrap(
        copy.deepcopy(model), split=["blocks.2"], devices=["cpu"] * 2, chunks=2, **PER_MICRO_BATCH
    )
    learning = pipepar.wrap(
        copy.deepcopy(model), split=["blocks.2"], devices=["cpu"] * 2, chunks=2, **PER_MICRO_BATCH
    )
    for step, sign in enumerate((-1.0, -1.0, 1.0)):
        x = _signed(sign)
        losses, states = [], []
        for pipe in (following, learning):
            if pipe is learning:
                pipe._compute._routes.__init__()  # forget every route: each step under the mode
            torch.manual_seed(10 + step)
            losses.append(pipe.step(x, loss_fn=lambda out, t: out.sum(), target=x))
            states.append(torch.get_rng_state())
        assert torch.equal(losses[0], losses[1]), step
        assert torch.equal(states[0], states[1]), step
    for a, b in zip(following.parameters(), learning.parameters()):
        assert torch.equal(a.grad, b.grad)


class NormedBranching(nn.Module):
    """Batch norm in training mode, and a block skipped when the inputs are positive."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(4)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for k, block in enumerate(self.blocks):
            if k == 1 and bool(x[0, 0] > 0):
                continue
            h = torch.tanh(block(h))
        return h


def test_a_step_run_again_updates_batch_norm_statistics_once() -> None:
    torch.manual_seed(0)
    plain = NormedBranching()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["blocks.2"], devices=["cpu"] * 2)
    for sign in (-1.0, -1.0, 1.0, -1.0):
        x = _signed(sign)
        pipe.step(x, loss_fn=lambda out, t: out.sum(), target=x)
        plain(x).sum().backward()
    expected = dict(plain.named_buffers())
    for name, b in pipe.named_buffers():
        _close(b.float(), expected[name].float(), name)
    _same_grads(pipe, plain)


class _Reused(nn.Module):
    """Block 0 runs again after the last block: its weights are used by both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.blocks[0](x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_unit_run_by_two_stages_at_once_keeps_their_weights_apart(schedule: str) -> None:
    """The later stage computes block 0 with a stand-in for its weights; the earlier stage,
    running block 0 for the next micro-batch on another thread at the same moment, must not
    see it (many small micro-batches: the calls overlap often)."""
    torch.manual_seed(0)
    plain = _Reused()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["blocks.2"], devices=["cpu"] * 2, chunks=16, schedule=schedule
    )
    for _ in range(5):
        x = torch.randn(64, 32)
        loss = pipe.step(x, loss_fn=lambda out, t: out.square().mean(), target=x)
        expected = torch.stack([plain(c).square().mean() for c in x.chunk(16)]).mean()
        expected.backward()
        _close(loss, expected.detach(), "loss")
        _same_grads(pipe, plain)
        pipe.zero_grad()
        plain.zero_grad()


def test_the_graph_check_finds_a_stage_that_computes_with_another_stages_values() -> None:
    from pipepar.program.route import PathChanged, check_graphs

    w0, w1 = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    owner = {id(w0): 0, id(w1): 1}
    a = w0 * torch.randn(3)  # stage 0's output
    leaf = a.detach().requires_grad_()  # its crossing leaf in stage 1
    apart = (w1 * leaf).sum()
    check_graphs([(a, 0), (apart, 1)], {id(leaf): 1}, owner, "key")
    joined = (w1 * a).sum()  # stage 1 uses stage 0's value itself
    with pytest.raises(PathChanged, match="stage 1 computes with stage 0's values"):
        check_graphs([(a, 0), (joined, 1)], {id(leaf): 1}, owner, "key")
    borrowed = (w1 * w0).sum()  # stage 1 uses stage 0's weight without an alias
    with pytest.raises(PathChanged, match="stage 1 reaches a leaf of stage 0"):
        check_graphs([(borrowed, 1), (a, 0)], {id(leaf): 1}, owner, "key")


class MiddleShortcut(nn.Module):
    """The middle stage adds block 0's output in its own code when the first input value is
    positive: found when the middle stage's output crosses into the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        first = torch.tanh(self.blocks[0](x))
        h = torch.tanh(self.blocks[1](first))
        if bool(x[0, 0] > 0):
            h = h + first
        h = torch.tanh(self.blocks[2](h))
        return torch.tanh(self.blocks[3](h))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_middle_stage_that_leaves_the_route_is_still_right(schedule: str) -> None:
    torch.manual_seed(0)
    plain = MiddleShortcut()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["blocks.1", "blocks.3"], devices=["cpu"] * 3, chunks=2,
        schedule=schedule, **PER_MICRO_BATCH,
    )  # fmt: skip
    _steps_leaving_and_rejoining_the_route(pipe, plain)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_each_stage_plans_its_backward_on_the_graph_the_route_check_walked(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Following a route, the graph check's walk of a micro-batch hands each stage the nodes
    it read: planning the stage's split backward reads none of them again (only what the
    loss head adds after the check, one view of the model's loss), every stage of every
    micro-batch takes its part once, and the step still equals the plain model."""
    from pipepar.core import split_backward
    from pipepar.program.cut import Ledger

    plans: list[tuple[int, int]] = []  # (nodes walked, nodes found known) per plan
    taken: list[bool] = []  # per hand-over: whether there was a walked graph to take
    walk, take = split_backward._Graph.__init__, Ledger.take_walked

    def spy_walk(self: Any, outputs: Any, inputs: Any, params: Any, known: Any = None) -> None:
        walk(self, outputs, inputs, params, known)
        plans.append((len(self.order), sum(n in (known or {}) for n in self.order)))

    def spy_take(self: Ledger, stage: int) -> Any:
        found = take(self, stage)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(split_backward._Graph, "__init__", spy_walk)
    monkeypatch.setattr(Ledger, "take_walked", spy_take)
    torch.manual_seed(0)
    plain = zoo.gpt2()
    split = SPLITS["gpt2"] if schedule == "zb-v" else SPLITS["gpt2"][1:2]
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=split, devices=["cpu"] * 2, chunks=2, schedule=schedule
    )
    for step in range(2):
        plans.clear()
        taken.clear()
        batch, y = _batch("gpt2", seed=0)
        _close(_pipe_step(pipe, batch, y), _plain_step(plain, batch, y), f"loss of step {step}")
        _same_grads(pipe, plain)
    stages = len(split) + 1
    assert len(taken) == 2 * stages and all(taken), "every stage of each micro-batch takes one"
    assert plans and all(nodes - known <= 1 for nodes, known in plans), plans
