"""Recompute and deferred batch norm for any model: ``checkpoint="always"``/``"except_last"``
recomputes each unit of a stage in backward, with the same results as the plain model (and
the same random draws as a pipe that keeps its activations); ``deferred_batch_norm=True``
tracks the whole mini-batch's statistics."""

from __future__ import annotations

import copy
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

import pipepar
from models import transformers_zoo as zoo
from pipepar.core.named_schedules import VIRTUAL
from tests._foreign_models import CachedLM, nano_batch
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
MODES = ["always", "except_last"]
CASES = [  # the five real models x every schedule, and the two V schedules of less memory
    *itertools.product(SPLITS, SCHEDULES),
    ("gpt2", "v-min"),
    ("llama", "v-half"),
]


def _wrap(model: nn.Module, name: str, schedule: str, checkpoint: str) -> nn.Module:
    virtual = schedule in VIRTUAL
    return pipepar.wrap(
        model,
        split=SPLITS[name] if virtual else SPLITS[name][1:2],
        devices=["cpu", "cpu"],
        chunks=2,
        schedule=schedule,
        checkpoint=checkpoint,
    )


@pytest.mark.parametrize("checkpoint", ["never", *MODES])
@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_every_model_schedule_and_checkpoint_mode_equals_the_plain_model(
    name: str, schedule: str, checkpoint: str
) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    pipe = _wrap(copy.deepcopy(plain), name, schedule, checkpoint)
    for step in range(2):
        batch, y = _batch(name, seed=step)
        with mode_calls() as ops:
            loss = _pipe_step(pipe, batch, y)
        _close(loss, _plain_step(plain, batch, y), f"loss of step {step}")
        _same_grads(pipe, plain)
        assert step == 0 or ops[0] == 0  # the learned route holds with recompute


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "zb-v"])
@pytest.mark.parametrize("name", ["gpt2", "vit_timm"])
def test_a_recompute_draws_what_the_first_forward_drew(
    name: str, schedule: str, checkpoint: str
) -> None:
    """With dropout, a recomputing pipe and one that keeps its activations draw the same masks
    (each micro-batch of each stage has its own random stream; a unit's recompute replays the
    stream from where the unit started)."""
    torch.manual_seed(0)
    model = zoo.build(name, dropout=0.2)
    keeping = _wrap(copy.deepcopy(model), name, schedule, "never")
    recomputing = _wrap(copy.deepcopy(model), name, schedule, checkpoint)
    for step in range(2):
        batch, y = _batch(name, seed=step)
        losses = []
        for pipe in (recomputing, keeping):
            torch.manual_seed(100 + step)
            losses.append(_pipe_step(pipe, batch, y))
        _close(losses[0], losses[1], f"loss of step {step}")
        _same_grads(recomputing, keeping)
        recomputing.zero_grad()
        keeping.zero_grad()


class Noisy(nn.Module):
    """Units that draw in their own code (``torch.rand_like``) as well as through dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_NoisyBlock() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _NoisyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.linear(x))
        return F.dropout(h * torch.rand_like(h), 0.3, self.training)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_own_random_operators_are_replayed(devices: list[str]) -> None:
    """One device (the default generator, no streams) or two (a stream per stage and
    micro-batch): the recomputing pipe computes what the keeping one does, and leaves the
    generator where it does."""
    torch.manual_seed(0)
    model = Noisy()
    split = ["blocks.2"] if len(devices) == 2 else None
    balance = None if split else [4]
    pipes = [
        pipepar.wrap(
            copy.deepcopy(model), balance, split=split, devices=devices, chunks=3, checkpoint=c
        )
        for c in ("always", "never")
    ]
    x = torch.randn(6, 8)
    losses, states = [], []
    for pipe in pipes:
        torch.manual_seed(7)
        losses.append(pipe.step(x, loss_fn=lambda out, t: out.square().sum(), target=x))
        states.append(torch.get_rng_state())
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(states[0], states[1])
    _same_grads(pipes[0], pipes[1])


def _attention_calls(pipe: nn.Module) -> list[int]:
    calls = [0]
    pipe.transformer.h[3].attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    ("checkpoint", "expected"), [("never", 4), ("except_last", 7), ("always", 8)]
)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_recomputed_unit_runs_once_more(checkpoint: str, expected: int, schedule: str) -> None:
    """A unit of a recomputing stage runs again in backward, once per micro-batch (also when
    the schedule splits backward into B and W); an evaluation recomputes nothing."""
    torch.manual_seed(0)
    pipe = pipepar.wrap(
        zoo.gpt2(),
        split=["transformer.h.2"],
        devices=["cpu", "cpu"],
        chunks=4,
        schedule=schedule,
        checkpoint=checkpoint,
    )
    calls = _attention_calls(pipe)
    ids = torch.randint(1, 64, (8, 8))
    pipe.step(input_ids=ids, labels=ids)
    assert calls[0] == expected
    calls[0] = 0
    with torch.no_grad():
        pipe.step(input_ids=ids, labels=ids)
    assert calls[0] == 4


class _Tracked(nn.Module):
    """A block whose intermediate value is kept only by autograd (``sin`` saves its input): a
    weak reference tells whether backward still holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.kept: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        a = self.linear(x)
        self.kept.append(weakref.ref(a))
        return torch.sin(a)


@pytest.mark.parametrize(("checkpoint", "held"), [("never", 4), ("except_last", 1), ("always", 0)])
def test_a_recomputing_stage_drops_what_its_units_saved(checkpoint: str, held: int) -> None:
    """Between forward and backward, a recomputing micro-batch's intermediate values are gone
    (only the units' arguments stay); the others' are held for backward."""
    model = nn.Sequential(*(_Tracked() for _ in range(2)))  # split by paths: the model route
    pipe = pipepar.wrap(model, split=["1"], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    out = pipe(torch.randn(8, 8))
    alive = sum(ref() is not None for ref in model[1].kept)
    assert alive == held
    out.sum().backward()
    assert model[1].linear.weight.grad is not None


def test_a_copy_of_a_recomputing_unit_runs_its_own_weights() -> None:
    torch.manual_seed(0)
    pipe = pipepar.wrap(
        zoo.gpt2(), split=["transformer.h.2"], devices=["cpu", "cpu"], checkpoint="always"
    )
    block = pipe.transformer.h[3]
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2.0)
    x = torch.randn(2, 5, block.ln_1.normalized_shape[0])
    assert not torch.allclose(twin(x)[0], block(x)[0])


def _resnet() -> nn.Module:
    """A torchvision ResNet of one block per layer: every kind of batch norm of ResNet-18 (the
    stem's, the blocks', the downsampling shortcuts') at half its weights."""
    torch.manual_seed(0)
    return torchvision.models.resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def test_deferred_batch_norm_tracks_the_whole_batch() -> None:
    """A torchvision ResNet: with deferred_batch_norm=True every batch norm updates its running
    statistics once per step (recompute or not), and the first one, whose input is the plain
    model's, holds the plain model's statistics of the whole batch; without, they are updated
    once per micro-batch."""
    plain = _resnet()
    deferred = {
        checkpoint: pipepar.wrap(
            copy.deepcopy(plain),
            split=["layer3"],
            devices=["cpu", "cpu"],
            chunks=4,
            deferred_batch_norm=True,
            checkpoint=checkpoint,
        )
        for checkpoint in ("never", "always")
    }
    per_microbatch = pipepar.wrap(
        copy.deepcopy(plain), split=["layer3"], devices=["cpu", "cpu"], chunks=4,
        batch_coupling="per-micro-batch",
    )  # fmt: skip
    for _ in range(2):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
        for pipe in (*deferred.values(), per_microbatch):
            pipe.step(x, loss_fn=F.cross_entropy, target=y)
        with torch.no_grad():
            plain(x)
    per_microbatch_buffers = dict(per_microbatch.named_buffers())
    for checkpoint, pipe in deferred.items():
        for stat in ("running_mean", "running_var"):
            torch.testing.assert_close(
                getattr(pipe.bn1, stat),
                getattr(plain.bn1, stat),
                rtol=1e-5,
                atol=1e-6,
                msg=f"{stat}, checkpoint={checkpoint}",
            )
        for name, b in pipe.named_buffers():
            if name.endswith("num_batches_tracked"):
                assert int(b) == 2, (name, checkpoint)
                assert int(per_microbatch_buffers[name]) == 8, name


def test_deferred_batch_norm_of_a_model_that_is_one() -> None:
    """The layer is kept, not replaced: a model that is itself a batch norm defers too."""
    model = nn.BatchNorm1d(4)
    plain = nn.BatchNorm1d(4)
    pipe = pipepar.wrap(model, [1], devices=["cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(8, 4) * 2 + 1
    pipe(x)
    plain(x)
    assert type(model) is nn.BatchNorm1d and int(model.num_batches_tracked) == 1
    torch.testing.assert_close(model.running_var, plain.running_var)


def test_deferred_batch_norm_forgets_a_failed_step() -> None:
    """A step that fails part way leaves the running statistics as they were."""
    model = _resnet()
    pipe = pipepar.wrap(
        model, split=["layer3"], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True
    )
    before = {n: b.clone() for n, b in pipe.named_buffers()}
    x = torch.randn(4, 3, 32, 32)

    def failing(out: Tensor, t: Tensor) -> Tensor:
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        pipe.step(x, loss_fn=failing, target=torch.zeros(4))
    for name, b in pipe.named_buffers():
        assert torch.equal(b, before[name]), name
    pipe.step(x, loss_fn=lambda out, t: out.sum(), target=x)
    assert int(dict(pipe.named_buffers())["bn1.num_batches_tracked"]) == 1


class _WritesIntoItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2.0) + self.linear(x)


def test_a_unit_writing_into_its_argument_is_named() -> None:
    """A unit with weights that writes into its own argument cannot be recomputed from it: the
    forward says so, naming the layer and the fix, before a backward fails obscurely."""
    model = nn.Sequential(nn.Linear(8, 8), _WritesIntoItsArgument(), nn.Linear(8, 8))
    pipe = pipepar.wrap(model, split=["2"], devices=["cpu", "cpu"], checkpoint="always")
    with pytest.raises(ValueError, match=r"_WritesIntoItsArgument writes into its own argument"):
        pipe(torch.randn(4, 8)).sum().backward()
    nothing_kept = pipepar.wrap(
        nn.Sequential(nn.Linear(8, 8), _WritesIntoItsArgument(), nn.Linear(8, 8)),
        split=["2"],
        devices=["cpu", "cpu"],
        checkpoint="never",
    )
    nothing_kept(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_batch_norm_under_recompute_counts_each_micro_batch_once(schedule: str) -> None:
    """A torchvision ResNet's batch norms (per micro-batch statistics): a recomputing pipe's
    loss, gradients and running statistics (``always`` and ``except_last``) are those of a
    pipe that keeps its activations."""
    pipes = {
        checkpoint: pipepar.wrap(
            _resnet(),
            split=["layer3"],
            devices=["cpu", "cpu"],
            chunks=4,
            schedule=schedule,
            checkpoint=checkpoint,
            batch_coupling="per-micro-batch",  # asked for: refused otherwise
        )
        for checkpoint in ("never", *MODES)
    }
    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    losses = {c: pipe.step(x, loss_fn=F.cross_entropy, target=y) for c, pipe in pipes.items()}
    kept = dict(pipes["never"].named_buffers())
    for checkpoint in MODES:
        _close(losses[checkpoint], losses["never"], f"loss, checkpoint={checkpoint}")
        _same_grads(pipes[checkpoint], pipes["never"])
        for name, b in pipes[checkpoint].named_buffers():
            torch.testing.assert_close(
                b, kept[name], rtol=1e-5, atol=1e-6, msg=f"{name}, checkpoint={checkpoint}"
            )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_recompute_sees_the_cache_its_first_run_saw(schedule: str) -> None:
    """Blocks that append their keys to a cache and number their positions after it: each
    recompute (one per B and W under zb-h1) gets the cache as the block's first run found it,
    not with that run's keys added (positions shifted: silently other gradients)."""
    torch.manual_seed(0)
    plain = CachedLM()
    idx, targets = nano_batch()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["h.2"], devices=["cpu", "cpu"], chunks=2,
        schedule=schedule, checkpoint="always",
    )  # fmt: skip
    loss = pipe.step(idx, targets)
    expected = plain(idx, targets)
    expected.backward()
    _close(loss, expected.detach(), "loss")
    _same_grads(pipe, plain)


def test_a_transformers_cache_is_recomputed_as_it_was() -> None:
    """Gemma2 (eager attention, an explicit mask) builds a key-value cache in training: its
    recompute under checkpoint="always" attends over the first run's keys, not twice as many
    (a size mismatch in backward before)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.Gemma2ForCausalLM(config)
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["model.layers.1"], devices=["cpu", "cpu"], chunks=2,
        checkpoint="always",
    )  # fmt: skip
    ids = torch.randint(1, 64, (4, 8))
    loss = pipe.step(input_ids=ids, labels=ids)
    expected = plain(input_ids=ids, labels=ids).loss
    expected.backward()
    _close(loss, expected.detach(), "loss")
    _same_grads(pipe, plain)
