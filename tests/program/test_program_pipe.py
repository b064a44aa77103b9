"""Any nn.Module through ``pipepar.wrap``: skip connections, keyword inputs, dict outputs, tied
weights and input gradients equal the plain model's under every schedule; bad input gets a
clear error; a failing layer's own exception reaches the caller."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.named_schedules import NAMES, VIRTUAL


class SkipNet(nn.Module):
    """Embedding, a list of blocks each adding the embedding back (a skip across stages), a
    head tied to the embedding, keyword arguments and a dict output."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Linear(6, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 6, bias=False)
        self.scale = nn.Parameter(torch.tensor(0.5))  # loose: held by the model itself

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.emb(x)
        skip = h * self.scale
        for block in self.blocks:
            h = block(h) + skip
            if mask is not None:
                h = h * mask
        h = self.norm(h)
        # the head reuses the embedding's weight (tied), as language models do
        logits = self.head(h) + h @ self.emb.weight
        return {"logits": logits, "hidden": h}


def _loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["logits"].pow(2).mean() + out["hidden"].mean() * 0.1


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_weight_held_by_another_stage_sums_its_gradient_in_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last stage uses the embedding's weight (held by the first): its gradient is summed
    over the four micro-batches as they come, one buffer per weight, not kept per micro-batch;
    the sum is the plain model's share."""
    from pipepar.program.step import SegmentStep

    torch.manual_seed(0)
    plain = SkipNet()
    model = copy.deepcopy(plain)
    seen: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
    release = SegmentStep.release

    def kept(self: SegmentStep) -> None:
        seen.append([(p, g.clone()) for p, g in self.tied])
        release(self)

    monkeypatch.setattr(SegmentStep, "release", kept)
    pipe = pipepar.wrap(model, [3, 4], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(8, 6)
    pipe.step(x, loss_fn=lambda o, _: _loss(o))
    first, last = seen
    assert first == [] and len(last) == 1
    param, total = last[0]
    assert param is model.emb.weight
    h = plain.norm(_stacked(plain, x))  # the last stage's use: h @ emb.weight, through the loss
    used = plain.emb.weight.detach().requires_grad_()
    logits = plain.head(h) + h @ used
    loss = logits.pow(2).mean() + h.mean() * 0.1
    (expected,) = torch.autograd.grad(loss, used)
    torch.testing.assert_close(total, expected)


def _stacked(model: SkipNet, x: torch.Tensor) -> torch.Tensor:
    h = model.emb(x)
    skip = h * model.scale
    for block in model.blocks:
        h = block(h) + skip
    return h


@pytest.mark.parametrize("schedule", NAMES)
def test_every_schedule_equals_plain(schedule: str) -> None:
    torch.manual_seed(0)
    plain = SkipNet()
    model = copy.deepcopy(plain)
    x = torch.randn(8, 6)
    mask = (torch.rand(8, 1) > 0.2).float()
    balance = [2, 2, 2, 1] if schedule in VIRTUAL else [3, 4]
    pipe = pipepar.wrap(model, balance, devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    out = pipe(x, mask=mask)
    expected = plain(x, mask=mask)
    torch.testing.assert_close(out["logits"], expected["logits"])
    _loss(out).backward()
    _loss(expected).backward()
    want = _grads(plain)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    model.zero_grad()
    plain.zero_grad()
    loss = pipe.step(x, mask=mask, loss_fn=lambda o, _: _loss(o))
    reference = _loss(plain(x, mask=mask))
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(model)[name], g, msg=name)


def test_input_gradient_reaches_the_caller() -> None:
    torch.manual_seed(0)
    plain = SkipNet()
    pipe = pipepar.wrap(copy.deepcopy(plain), [3, 4], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    _loss(pipe(x)).backward()
    _loss(plain(x2)).backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_no_grad_forward_equals_plain() -> None:
    plain = SkipNet().eval()
    pipe = pipepar.wrap(copy.deepcopy(plain), [3, 4], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(7, 6)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x)["logits"], plain(x)["logits"])


def test_units_and_split_by_module_path() -> None:
    model = SkipNet()
    paths = [u.path for u in pipepar.units(model)]
    assert paths == ["emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    pipe = pipepar.wrap(model, split=["blocks.2"], devices=["cpu", "cpu"])
    assert pipe.stage_paths == [
        ["emb", "blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3", "norm", "head"],
    ]
    assert pipe.balance == [3, 4]


def test_any_single_module_is_one_unit() -> None:
    layer = nn.Linear(3, 2)
    pipe = pipepar.wrap(copy.deepcopy(layer), [1], devices=["cpu"], chunks=2)
    x = torch.randn(4, 3)
    torch.testing.assert_close(pipe(x), layer(x))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"module must be an nn.Module, but got str"):
        pipepar.wrap("model", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"split names 'blocks.9'.*the units are"):
        pipepar.wrap(SkipNet(), split=["blocks.9"], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"in model order"):
        pipepar.wrap(SkipNet(), split=["blocks.2", "blocks.1"], devices=["cpu"] * 3)
    with pytest.raises(ValueError, match=r"balance or split, not both"):
        pipepar.wrap(SkipNet(), [3, 4], split=["blocks.2"], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"counts 6 units but the model lays out in 7: \[emb, "):
        pipepar.wrap(SkipNet(), [3, 3], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"checkpoint must be one of"):
        pipepar.wrap(SkipNet(), [3, 4], devices=["cpu", "cpu"], checkpoint="sometimes")
    with pytest.raises(ValueError, match=r"no sample was given"):
        pipepar.wrap(SkipNet(), devices=["cpu", "cpu"])


class Faulty(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("boom")


def test_a_failing_layers_exception_reaches_the_caller() -> None:
    model = SkipNet()
    model.blocks[2] = nn.Sequential(nn.Linear(8, 8), Faulty())
    pipe = pipepar.wrap(model, [3, 4], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(KeyError, match="boom") as info:
        pipe(torch.randn(4, 6))
    assert any("blocks.2" in note for note in getattr(info.value, "__notes__", []))
    # the pipe still works afterwards
    model.blocks[2] = nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def test_outputs_that_cannot_be_joined_are_refused() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
            return self.b(self.a(x)), object()

    pipe = pipepar.wrap(Odd(), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"differs between micro-batches.*use_cache=False"):
        pipe(torch.randn(4, 2))


def test_a_tensor_with_history_from_outside_the_call_is_refused() -> None:
    class Cached(nn.Module):
        """Keeps a tensor of one call's graph and uses it in the next: its gradient could not
        reach the stage that made it."""

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.kept: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            out = self.b(h if self.kept is None else h + self.kept)
            self.kept = h[:1]
            return out

    pipe = pipepar.wrap(Cached(), [1, 1], devices=["cpu", "cpu"])
    pipe(torch.randn(3, 2))
    with pytest.raises(RuntimeError, match=r"state 'kept' the model keeps on itself"):
        pipe(torch.randn(3, 2))


class _KeptState(nn.Module):
    """Keeps a state of each call's graph on itself, as a recurrent model's cache does, and
    reads its shape in the next call to decide whether to start afresh: only its shape, so
    each call computes from its own input alone. With ``use_state`` it also adds the state's
    values: a call depends on the previous one's graph."""

    def __init__(self, use_state: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_state = use_state
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.state is None or self.state.shape[0] != x.shape[0]:
            self.state = torch.zeros_like(h)
        out = self.b(h + self.state if self.use_state else h * 2)
        self.state = out
        return out


def test_reading_the_shape_of_a_state_kept_from_an_earlier_call_trains_exactly() -> None:
    torch.manual_seed(0)
    model, x = _KeptState(use_state=False), torch.randn(4, 4)
    plain = copy.deepcopy(model)
    plain(x).square().sum().backward()
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    pipe(x)  # the state kept from this call is read (its shape) by the next
    pipe(x).square().sum().backward()
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7), name


def test_using_the_values_of_a_state_kept_from_an_earlier_call_is_refused_naming_caches() -> None:
    pipe = pipepar.wrap(_KeptState(use_state=True), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(RuntimeError, match=r"state 'state' the model keeps.*use_cache=False"):
        # The first call's micro-batch 1 reads micro-batch 0's state if its stage has written
        # it by then (the threads decide); the second call reads the first one's in any case.
        pipe(torch.randn(4, 4))
        pipe(torch.randn(4, 4))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_backward_of_a_call_runs_on_the_callers_thread_where_the_pipe_asks_it(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the backward of ``pipe(...)`` runs on the autograd engine's device thread, where
    a stage worker's backward would queue behind it: the pipe asks for the caller's thread
    (``workers(backward=True)`` is None there). The same walk on the CPU equals the plain
    model."""
    from pipepar.local.pipe_view import PipeView

    asked: list[bool] = []
    workers = PipeView.workers

    def caller_thread_for_backward(self: PipeView, *, backward: bool = False) -> object:
        asked.append(backward)
        return None if backward else workers(self)

    monkeypatch.setattr(PipeView, "workers", caller_thread_for_backward)
    torch.manual_seed(0)
    plain = SkipNet()
    split = ["blocks.1", "blocks.2", "blocks.3"] if schedule in VIRTUAL else ["blocks.2"]
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=split, devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    x = torch.randn(8, 6)
    _loss(pipe(x)).backward()
    _loss(plain(x)).backward()
    assert asked[-1] is True and not any(asked[:-1])
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(pipe)[name], g, msg=name)
