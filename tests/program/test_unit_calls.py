"""Recompute in the schedule's bubbles for any model (``recompute="bubbles"``): each
checkpointed micro-batch's units run again in an ``R`` action ahead of its backward, and the
pipe still gives the plain model's numbers (and, with dropout, a pipe's that keeps its
activations or recomputes in place)."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

import pipepar
from models import transformers_zoo as zoo
from pipepar.core.schedule import Action, Schedule, parse
from pipepar.program.step import SegmentStep
from tests.program._real import _close, _same_grads
from tests.program.test_recompute import _Tracked

CASES = [("1f1b", 1), ("zb-v", 3)]  # the schedule, and how many of its split names cut it
GPT2_SPLIT = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
RESNET_SPLIT = ["layer2", "layer3", "layer4"]


def _wrap(model: nn.Module, split: list[str], schedule: str, **kw: object) -> nn.Module:
    return pipepar.wrap(
        model,
        split=split,
        devices=["cpu", "cpu"],
        chunks=4,
        schedule=schedule,
        **kw,  # type: ignore[arg-type]
    )


def _ids(step: int) -> Tensor:
    return torch.randint(1, 64, (8, 8), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize(("schedule", "cuts"), CASES)
def test_gpt2_recomputing_in_the_bubbles_equals_the_plain_model(schedule: str, cuts: int) -> None:
    """transformers' GPT-2 (its head tied to the embedding) over two steps: the second places
    its recomputes on the stages' measured times."""
    torch.manual_seed(0)
    plain = zoo.gpt2()
    pipe = _wrap(
        copy.deepcopy(plain),
        GPT2_SPLIT[-cuts:],
        schedule,
        checkpoint="always",
        recompute="bubbles",
    )
    for step in range(2):
        assert any(a.kind == "R" for w in pipe.schedule.actions for a in w)
        ids = _ids(step)
        loss = pipe.step(input_ids=ids, labels=ids)
        expected = plain(input_ids=ids, labels=ids).loss
        expected.backward()
        _close(loss, expected.detach(), f"loss of step {step}")
        _same_grads(pipe, plain)


@pytest.mark.parametrize(("schedule", "cuts"), CASES)
def test_gpt2_with_dropout_draws_what_recomputing_in_place_draws(schedule: str, cuts: int) -> None:
    """Dropout on: the recompute in an R replays the first run's masks, so the pipe computes
    what the same pipe keeping its activations, or recomputing inside B, computes."""
    torch.manual_seed(0)
    model = zoo.gpt2(dropout=0.2)
    runs = [("never", "in_place"), ("always", "in_place"), ("always", "bubbles")]
    pipes = {
        run: _wrap(
            copy.deepcopy(model),
            GPT2_SPLIT[-cuts:],
            schedule,
            checkpoint=run[0],
            recompute=run[1],
        )
        for run in runs
    }
    for step in range(2):
        got = {}
        for run, pipe in pipes.items():
            torch.manual_seed(100 + step)
            ids = _ids(step)
            got[run] = pipe.step(input_ids=ids, labels=ids)
        kept = pipes["never", "in_place"]
        for run in runs[1:]:
            _close(got[run], got["never", "in_place"], f"loss of {run}, step {step}")
            _same_grads(pipes[run], kept)
        # The same operations on the same values, bit for bit (the split backward's too).
        in_place, bubbles = pipes["always", "in_place"], pipes["always", "bubbles"]
        assert torch.equal(got["always", "in_place"], got["always", "bubbles"])
        for a, b in zip(in_place.parameters(), bubbles.parameters()):
            assert torch.equal(a.grad, b.grad)
        for pipe in pipes.values():
            pipe.zero_grad()


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


@pytest.mark.parametrize(("schedule", "cuts"), CASES)
def test_batch_norm_counts_each_micro_batch_once_when_recomputed_in_the_bubbles(
    schedule: str, cuts: int
) -> None:
    """A torchvision ResNet, batch norm per micro-batch as asked (``batch_coupling=``; it
    would be refused otherwise): loss, gradients and running
    statistics of the plain model run micro-batch by micro-batch, over two steps (within
    the rounding of its whole-batch backward, which a pipe keeping its activations shows
    too), and those of the pipe recomputing in place."""
    plain = _resnet()
    pipes = {
        recompute: _wrap(
            copy.deepcopy(plain),
            RESNET_SPLIT[-cuts:],
            schedule,
            checkpoint="always",
            recompute=recompute,
            batch_coupling="per-micro-batch",
        )
        for recompute in ("in_place", "bubbles")
    }
    pipe = pipes["bubbles"]
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(10, (8,), generator=gen)
        losses = {r: p.step(x, loss_fn=F.cross_entropy, target=y) for r, p in pipes.items()}
        expected = F.cross_entropy(torch.cat([plain(part) for part in x.chunk(4)]), y)
        expected.backward()
        _close(losses["bubbles"], expected.detach(), f"loss of step {step}")
        _same_grads(pipe, plain, rtol=5e-5)
        _close(losses["bubbles"], losses["in_place"], f"loss against in place, step {step}")
        _same_grads(pipe, pipes["in_place"])
        kept = dict(plain.named_buffers())
        for name, b in pipe.named_buffers():
            torch.testing.assert_close(b, kept[name], rtol=1e-5, atol=1e-6, msg=name)


class _Tied(nn.Module):
    """An embedding and a head sharing one weight, the head in another stage's checkpointed
    unit (it runs on a stand-in of the weight there), with dropout in between."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(dropout)) for _ in range(3)
        )
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _token_loss(out: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), ids.flatten())


def _tied_pipe(model: nn.Module, checkpoint: str, recompute: str) -> nn.Module:
    return pipepar.wrap(
        model,
        split=["blocks.2"],
        devices=["cpu", "cpu"],
        chunks=4,
        schedule="1f1b",
        checkpoint=checkpoint,
        recompute=recompute,
    )


def test_a_tied_weight_used_in_a_rebuilt_unit_gets_the_plain_models_gradient() -> None:
    torch.manual_seed(0)
    plain = _Tied(dropout=0.0)
    pipe = _tied_pipe(copy.deepcopy(plain), "always", "bubbles")
    ids = torch.randint(32, (8, 5))
    loss = pipe.step(ids, loss_fn=_token_loss, target=ids)
    expected = _token_loss(plain(ids), ids)
    expected.backward()
    _close(loss, expected.detach(), "loss")
    _same_grads(pipe, plain)
    assert pipe.head.weight is pipe.embed.weight


def test_a_tied_weight_with_dropout_gets_the_kept_pipes_gradient() -> None:
    torch.manual_seed(0)
    model = _Tied(dropout=0.2)
    runs = [("never", "in_place"), ("always", "bubbles")]
    pipes = [_tied_pipe(copy.deepcopy(model), *run) for run in runs]
    ids = torch.randint(32, (8, 5))
    losses = []
    for pipe in pipes:
        torch.manual_seed(3)
        losses.append(pipe.step(ids, loss_fn=_token_loss, target=ids))
    _close(losses[1], losses[0], "loss")
    _same_grads(pipes[1], pipes[0])


_phase = threading.local()


@contextlib.contextmanager
def _phases() -> Iterator[None]:
    """Notes, on the thread that runs it, whether a stage's R or B is running."""
    rebuild, backward = SegmentStep.rebuild, SegmentStep.backward

    def marked(kind: str, method):  # type: ignore[no-untyped-def]
        def run(self, *args):  # type: ignore[no-untyped-def]
            _phase.kind = kind
            try:
                return method(self, *args)
            finally:
                _phase.kind = None

        return run

    SegmentStep.rebuild = marked("R", rebuild)  # type: ignore[method-assign]
    SegmentStep.backward = marked("B", backward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        SegmentStep.rebuild, SegmentStep.backward = rebuild, backward  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("recompute", "schedule", "in_r", "in_b"),
    [
        ("in_place", "1f1b", 0, 4),
        ("bubbles", "1f1b", 4, 0),
        ("bubbles", "zb-h1", 4, 0),  # split backward: B and W read what R rebuilt
        ("in_place", parse("F0 F1 F2 R0 B0 R1 B1 R2 B2 | F0 R0 B0 F1 B1 F2 R2 B2"), 2, 1),
    ],
)
def test_the_units_run_again_in_r_not_in_b(
    recompute: str, schedule: object, in_r: int, in_b: int
) -> None:
    """Calls of a unit of the second stage during its R and during its B: with the
    recomputes listed, each checkpointed micro-batch's runs once more, in its R; where the
    schedule lists none (micro-batch 1 of the given schedule), inside its B."""
    torch.manual_seed(0)
    chunks = 4 if isinstance(schedule, str) else 3
    pipe = pipepar.wrap(
        zoo.gpt2(),
        split=["transformer.h.2"],
        devices=["cpu", "cpu"],
        chunks=chunks,
        schedule=schedule,  # type: ignore[arg-type]
        checkpoint="always",
        recompute=recompute,
    )
    calls = {"R": 0, "B": 0, None: 0}

    def count(*args: object) -> None:
        calls[getattr(_phase, "kind", None)] += 1

    pipe.transformer.h[3].attn.register_forward_hook(count)
    ids = torch.randint(1, 64, (2 * chunks, 8))
    with _phases():
        pipe.step(input_ids=ids, labels=ids)
    assert (calls["R"], calls["B"], calls[None]) == (in_r, in_b, chunks)


def test_a_rebuilt_micro_batch_holds_nothing_before_its_r_and_frees_it_after_its_b() -> None:
    """After the forward, what the units saved is gone (only their arguments stay); the R
    rebuilds it, and the backward lets go of it, as with the recompute inside B."""
    model = nn.Sequential(_Tracked(), _Tracked())  # split by paths: the model's own forward
    pipe = pipepar.wrap(
        model, split=["1"], devices=["cpu", "cpu"], chunks=4, checkpoint="always",
        recompute="bubbles",
    )  # fmt: skip
    out = pipe(torch.randn(8, 8))
    assert sum(ref() is not None for ref in model[1].kept) == 0
    out.sum().backward()
    rebuilt = model[1].kept[4:]  # the recomputes' values, made in the R actions
    assert len(rebuilt) == 4 and all(ref() is None for ref in rebuilt)
    assert model[1].linear.weight.grad is not None


class _Fickle(nn.Module):
    """Saves one tensor for backward on its first run and two on the next."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.runs = 0

    def forward(self, x: Tensor) -> Tensor:
        self.runs += 1
        y = self.linear(x)
        return torch.sin(torch.sin(y)) if self.runs % 2 == 0 else y * 2


def test_a_unit_that_saves_otherwise_when_recomputed_is_named() -> None:
    model = nn.Sequential(nn.Linear(8, 8), _Fickle())
    pipe = pipepar.wrap(
        model, split=["1"], devices=["cpu", "cpu"], chunks=1, checkpoint="always",
        recompute="bubbles",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"recomputing _Fickle saved more than the"):
        pipe(torch.randn(4, 8)).sum().backward()


class _Slow(nn.Linear):
    """A linear layer that takes 20 ms more: a stage much slower than the others."""

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.02)
        return super().forward(x)


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Slow(8, 8), *(nn.Linear(8, 8) for _ in range(3))])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _moved(schedule: Schedule) -> int:
    """R listed anywhere but just before their own B."""
    pairs = [p for w in schedule.actions for p in zip(w, (*w[1:], None))]
    return sum(1 for a, b in pairs if a.kind == "R" and b != Action(a.stage, "B", a.microbatch))


def test_after_the_first_step_recomputes_are_placed_on_the_measured_stage_times() -> None:
    """On unit costs no R of this ZB-V moves; measured, stage 0 is slow, and the other stage
    of its device idles: R fill those waits, and the numbers stay the plain model's."""
    torch.manual_seed(0)
    plain = _Layers()
    pipe = _wrap(
        copy.deepcopy(plain),
        ["layers.1", "layers.2", "layers.3"],
        "zb-v",
        checkpoint="always",
        recompute="bubbles",
    )
    assert _moved(pipe.schedule) == 0
    for _ in range(2):
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        loss = pipe.step(x, loss_fn=F.mse_loss, target=y)
        _close(loss, F.mse_loss(plain(x), y), "loss")
    assert _moved(pipe.schedule) > 0
