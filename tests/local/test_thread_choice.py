"""Who runs one process's actions: the workers, the calling thread, or whichever was faster.

The choice changes where the actions run, never what they compute: every test compares with
the plain model (and the two places with each other, bit for bit).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core import switches
from pipepar.local import thread_choice
from pipepar.local.thread_choice import TRIALS, WARMUP, ThreadChoice, choice_for

CALLS = WARMUP + 2 * TRIALS  # a kind's calls until its choice is made


class _Where(nn.Module):
    """A linear layer that notes the threads computing its forward and its backward."""

    def __init__(self, width: int, seen: set[str]) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add(threading.current_thread().name)
        x = torch.relu(self.linear(x))
        if x.requires_grad:
            x.register_hook(self._backward_seen)
        return x

    def _backward_seen(self, grad: torch.Tensor) -> None:
        self.seen.add("backward on " + threading.current_thread().name)


class _Net(nn.Module):
    """Not a Sequential: the pipe cuts its forward while it runs."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model(program: bool, seen: set[str]) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [_Where(8, seen) for _ in range(4)]
    return _Net(blocks) if program else nn.Sequential(*blocks)


def _pipe(model: nn.Module, program: bool, schedule: str, **options: str) -> pipepar.Pipe:
    split = {"split": ["blocks.2"]} if program else {"balance": [2, 2]}
    if schedule == "zb-v":
        split = {"split": ["blocks.1", "blocks.2", "blocks.3"]} if program else {"balance": [1] * 4}
    return pipepar.wrap(  # type: ignore[arg-type]
        model, devices=["cpu", "cpu"], chunks=4, schedule=schedule, **split, **options
    )


def _trained(
    monkeypatch: pytest.MonkeyPatch, run_on: str, program: bool, schedule: str, steps: int
) -> tuple[list[list[torch.Tensor]], set[str], pipepar.Pipe]:
    """Each step's gradients through a pipe under ``PIPEPAR_RUN_ON=run_on``, the threads that
    computed, and the plain model."""
    monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
    seen: set[str] = set()
    model = _model(program, seen)
    plain = copy.deepcopy(model)
    pipe = _pipe(model, program, schedule)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    grads = []
    for _ in range(steps):
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad()
    nn.functional.mse_loss(plain(x), y).backward()
    for got, want in zip(grads[-1], [p.grad for p in plain.parameters()]):
        torch.testing.assert_close(got, want)
    return grads, seen, pipe


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
@pytest.mark.parametrize("program", [False, True], ids=["chain", "program"])
def test_the_calling_thread_computes_the_same_bits_as_the_workers(
    monkeypatch: pytest.MonkeyPatch, program: bool, schedule: str
) -> None:
    on_workers, workers_seen, _ = _trained(monkeypatch, "workers", program, schedule, 2)
    on_caller, caller_seen, _ = _trained(monkeypatch, "caller", program, schedule, 2)
    here = threading.current_thread().name
    assert {n for n in workers_seen if n.startswith("backward")} == {
        "backward on pipepar-stage0_0",
        "backward on pipepar-stage1_0",
    }
    assert {n for n in caller_seen if n.startswith("backward")} == {f"backward on {here}"}
    if not program:  # a model's forward runs on its micro-batches' drivers either way
        assert {n for n in workers_seen if not n.startswith("backward")} == {
            "pipepar-stage0_0",
            "pipepar-stage1_0",
        }
        assert {n for n in caller_seen if not n.startswith("backward")} == {here}
    for step_workers, step_caller in zip(on_workers, on_caller):
        for a, b in zip(step_workers, step_caller):
            assert torch.equal(a, b)


def test_the_calling_thread_computes_with_the_workers_math_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Convolutions split their work by the math threads, and so their rounding: the calling
    thread computes with the workers' one thread each, whatever its own count."""

    def grads(run_on: str) -> list[torch.Tensor]:
        monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.Flatten(), nn.Linear(32 * 24 * 24, 4),
        )  # fmt: skip
        pipe = pipepar.wrap(model, [3, 4], devices=["cpu", "cpu"], chunks=2, threads=1)
        torch.manual_seed(1)
        x, y = torch.randn(8, 3, 24, 24), torch.randn(8, 4)
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        return [p.grad for p in model.parameters() if p.grad is not None]

    own = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        on_workers, on_caller = grads("workers"), grads("caller")
        assert torch.get_num_threads() == 4  # the caller's own count, back
    finally:
        torch.set_num_threads(own)
    assert len(on_workers) == len(on_caller) == 8
    for a, b in zip(on_workers, on_caller):
        assert torch.equal(a, b)


@pytest.mark.parametrize("program", [False, True], ids=["chain", "program"])
def test_auto_times_both_then_keeps_one_and_every_step_equals_the_plain_model(
    monkeypatch: pytest.MonkeyPatch, program: bool
) -> None:
    grads, seen, pipe = _trained(monkeypatch, "auto", program, "1f1b", CALLS + 1)
    for step in grads[1:]:  # the same bits whichever ran each step
        for a, b in zip(grads[0], step):
            assert torch.equal(a, b)
    choice = pipe._view.thread_choice
    made = list(choice.choices().values())
    assert len(made) == 1 and made[0] is not None
    here = threading.current_thread().name  # the trials ran on both
    assert {f"backward on {here}", "backward on pipepar-stage0_0"} <= seen


def test_the_choice_warms_up_on_the_workers_then_alternates_and_keeps_the_faster() -> None:
    choice = ThreadChoice("auto")
    sides = []
    for _ in range(CALLS):
        caller = choice.on_caller("step")
        sides.append(caller)
        assert choice.chosen("step") is None
        choice.took("step", caller, 1.0 if caller else 2.0)
    assert sides == [False] * WARMUP + [False, True] * TRIALS
    assert choice.chosen("step") is True and choice.on_caller("step") is True
    assert choice.on_caller("eval") is False  # another kind is timed on its own


def test_within_the_margin_the_workers_are_kept() -> None:
    choice = ThreadChoice("auto")
    for _ in range(CALLS):
        caller = choice.on_caller("step")
        choice.took("step", caller, 1.0 if caller else 1.0 * thread_choice.MARGIN * 0.99)
    assert choice.chosen("step") is False and choice.on_caller("step") is False


def test_a_fixed_mode_is_not_timed() -> None:
    for mode, caller in (("workers", False), ("caller", True)):
        choice = ThreadChoice(mode)
        for _ in range(CALLS):
            assert choice.on_caller("step") is caller
            choice.took("step", caller, 1.0)
        assert choice.chosen("step") is caller


def test_pipes_with_an_accelerator_keep_their_workers_unless_told() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choice_for([cpu, cpu], "auto").mode == "auto"
    assert choice_for([cpu, cuda], "auto").mode == "workers"
    assert choice_for([cpu, cuda], "caller").mode == "caller"


def test_a_wrong_switch_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPAR_RUN_ON", "threads")
    with pytest.raises(ValueError, match=r"PIPEPAR_RUN_ON.*auto, workers, caller.*'threads'"):
        switches.run_on()
    with pytest.raises(ValueError, match="mode must be"):
        ThreadChoice("threads")


def test_training_and_evaluation_are_timed_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, pipe = _trained(monkeypatch, "auto", False, "1f1b", CALLS)
    x = torch.randn(16, 8)
    with torch.no_grad():
        evaluated = pipe(x)
    choice = pipe._view.thread_choice
    made = list(choice.choices().values())
    assert len(made) == 2 and made[1] is None  # the evaluation's trials have not started
    torch.testing.assert_close(evaluated, pipe.module(x))


def test_the_trials_run_again_after_a_while() -> None:
    choice = ThreadChoice("auto")
    for _ in range(CALLS):
        caller = choice.on_caller("step")
        choice.took("step", caller, 1.0 if caller else 2.0)  # the calling thread was faster
    for _ in range(thread_choice.RECHECK):
        assert choice.on_caller("step") is True
        choice.took("step", True, 1.0)
    sides = []
    for _ in range(2 * TRIALS):  # timed again, no warm-up: now the workers are faster
        caller = choice.on_caller("step")
        sides.append(caller)
        choice.took("step", caller, 2.0 if caller else 1.0)
    assert sides == [False, True] * TRIALS
    assert choice.chosen("step") is False


def _to_bfloat16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.dtype == torch.float32 else t


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
@pytest.mark.parametrize(
    ("program", "checkpoint"), [(False, "never"), (False, "always"), (True, "never")]
)
def test_the_callers_saved_tensor_hooks_apply_on_the_workers_and_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch, schedule: str, program: bool, checkpoint: str
) -> None:
    """Hooks set around the step (here: what the forward saves kept in bfloat16) are
    thread-local, as autocast is: the calling thread had them and the workers had not, so the
    two computed different gradients. Both apply them now, as the plain model does (a model's
    micro-batch drivers too)."""

    def grads(run_on: str) -> list[torch.Tensor]:
        monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
        model = _model(program, set())
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        with torch.autograd.graph.saved_tensors_hooks(_to_bfloat16, _to_float32):
            if run_on == "plain":
                nn.functional.mse_loss(model(x), y).backward()
            else:
                pipe = _pipe(model, program, schedule, checkpoint=checkpoint)
                pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        return [p.grad for p in model.parameters()]  # type: ignore[misc]

    plain, on_workers, on_caller = grads("plain"), grads("workers"), grads("caller")
    for a, b, want in zip(on_workers, on_caller, plain):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want)


@pytest.mark.parametrize("run_on", ["workers", "caller"])
def test_a_calls_output_outlives_its_pipe_until_its_backward(
    monkeypatch: pytest.MonkeyPatch, run_on: str
) -> None:
    """``pipepar.wrap(model, ...)(x).sum().backward()`` with the pipe collected before the
    backward runs (no name holds it): the backward runs where the pipe chose, with the math
    threads and the parameters' hooks it said, and gives the plain model's gradients."""
    monkeypatch.setenv("PIPEPAR_RUN_ON", run_on)
    seen: set[str] = set()
    model, plain = _model(False, seen), _model(False, set())
    x = torch.randn(4, 8)
    out = pipepar.wrap(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)(x)
    out.sum().backward()
    plain(x).sum().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7)
