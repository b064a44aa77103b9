"""The state a pipe across ranks gathers is the trained state: batch-norm statistics and every
other buffer come from the rank whose stage updates them, not from another rank's stale copy.

Two ranks train a small conv net with a batch norm in each stage, as a model of its own (the
program compute: every rank keeps every buffer, but updates only its stages') and as an
``nn.Sequential`` (the chain), one micro-batch per step so that the statistics are the plain
model's. ``full_state_dict()`` on every rank, a sharded checkpoint loaded into a fresh pipe,
the one-file checkpoint and ``pipepar convert`` of the sharded one must all equal the plain
model trained on the same batches, buffers included.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipepar.cli.main import main as cli
from tests._ranks import spawn

pytestmark = pytest.mark.slow
STEPS = 3


class ConvNet(nn.Module):
    """Not an ``nn.Sequential``: its units are ``stem``, ``body`` and ``head``, a batch norm in
    the stem (stage 0) and in the body (stage 1); ``calls`` is a buffer of the model itself,
    outside every unit, that its forward counts in."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def conv_chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5),
    )  # fmt: skip


MODELS = {"program": (ConvNet, [1, 2]), "chain": (conv_chain, [3, 6])}


def _model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 3, 5, 5, generator=g), torch.arange(6) % 5) for _ in range(STEPS)]


def _train(module: nn.Module, step: Any) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for x, y in _batches():
        step(x, y)
        opt.step()
        opt.zero_grad()


def _plain(name: str) -> dict[str, torch.Tensor]:
    model = _model(name, seed=0).train()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.cross_entropy(model(x), y).backward()

    _train(model, step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipe_step(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    pipe.step(x, target=y, loss_fn=nn.functional.cross_entropy)


def _on_ranks(rank: int, folder: str) -> dict[str, Any]:
    import pipepar.distributed as ppd

    out: dict[str, Any] = {}
    for name, (_, balance) in MODELS.items():
        pipe = ppd.wrap(_model(name, seed=0), balance, chunks=1).train()
        _train(pipe, functools.partial(_pipe_step, pipe))
        out[f"{name} full_state_dict"] = pipe.full_state_dict()
        sharded, one_file = os.path.join(folder, name), os.path.join(folder, f"{name}.pt")
        ppd.save_checkpoint(sharded, pipe, None)
        ppd.save_checkpoint(one_file, pipe, None)
        pipe.close()
        fresh = ppd.wrap(_model(name, seed=1), balance, chunks=1)
        ppd.load_checkpoint(sharded, fresh)
        out[f"{name} sharded, loaded"] = fresh.full_state_dict()
        fresh.close()
        dist.barrier()  # every writer is done before rank 0 reads the files
        if rank == 0:
            out[f"{name} one file"] = torch.load(one_file, weights_only=True)["model"]
            converted = os.path.join(folder, f"{name}-converted.pt")
            assert cli(["convert", sharded, converted]) == 0
            out[f"{name} sharded, converted"] = torch.load(converted, weights_only=True)["model"]
    return {what: {k: v.numpy().copy() for k, v in state.items()} for what, state in out.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    folder: Path = tmp_path_factory.mktemp("trained_state")
    return spawn(2, functools.partial(_on_ranks, folder=str(folder)))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_gather_is_the_trained_state(ranks: dict[int, Any], name: str) -> None:
    """Every entry equal to the plain model's (the stage-0 batch norm's statistics were rank 1's
    stale copy), then the same keys in the same order (the model's own buffer was missing)."""
    plain = _plain(name)
    assert any(k.endswith("running_mean") for k in plain)
    for rank, got in ranks.items():
        for what, state in got.items():
            if not what.startswith(name):
                continue
            for k, v in plain.items():
                if k in state:
                    where = f"rank {rank}, {what}: {k}"
                    torch.testing.assert_close(torch.from_numpy(state[k]), v, msg=where)
            assert list(state) == list(plain), (rank, what)
