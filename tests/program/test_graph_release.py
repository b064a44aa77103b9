"""A model pipe lets go of each micro-batch's graph on a stage as soon as the stage's last
backward action for it has run (B, or W where B left work), not at the mini-batch's end: what
the forward saved is freed while later micro-batches run. The case that needs it: a weight
whose gradient needs autograd again in W (here a custom function's), so that B keeps the
graph; and the first stage, whose W runs the whole backward."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipepar

M = 8


class _Kept(torch.autograd.Function):
    """``x * w`` saving a tensor that only its graph holds (a weak reference tells when the
    graph let go of it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, alive: list[weakref.ref[Tensor]]) -> Tensor:
        kept = x.clone()
        ctx.save_for_backward(kept, w)
        alive.append(weakref.ref(kept))
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        kept, w = ctx.saved_tensors
        return g * w, (g * kept).sum(0), None


class Scaled(nn.Module):
    """A weight through :class:`_Kept`; records, at each forward, how many earlier
    micro-batches' saved tensors are still alive."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.saved: list[weakref.ref[Tensor]] = []
        self.most_alive = 0

    def forward(self, x: Tensor) -> Tensor:
        alive = sum(ref() is not None for ref in self.saved)
        self.most_alive = max(self.most_alive, alive)
        return _Kept.apply(x, self.weight, self.saved)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = Scaled(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def scales(self) -> list[Scaled]:
        return [block.scale for block in self.blocks]


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize(
    ("schedule", "split"),
    [
        ("1f1b", ["blocks.2"]),
        ("zb-h1", ["blocks.2"]),
        ("zb-v", ["blocks.1", "blocks.2", "blocks.3"]),
        ("interleaved-1f1b", ["blocks.1", "blocks.2", "blocks.3"]),
    ],
)
def test_a_stage_frees_each_micro_batch_after_its_last_backward_action(
    schedule: str, split: list[str]
) -> None:
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    x, y = torch.randn(4 * M, 16), torch.randn(4 * M, 16)
    pipe = pipepar.wrap(
        model, split=split, devices=["cpu", "cpu"], chunks=M, schedule=schedule, checkpoint="never"
    )
    for _ in range(2):  # the second step follows the route the first one learnt
        for scale in model.scales():
            scale.saved.clear()
        pipe.step(x, target=y, loss_fn=_loss)
    most = [scale.most_alive for scale in model.scales()]
    assert max(most) <= 3, f"micro-batches still holding their graph at a forward: {most}"
    for scale in model.scales():  # and none after the step
        assert all(ref() is None for ref in scale.saved)

    _loss(plain(x), y).backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad / 2, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def _on_ranks(rank: int) -> dict[str, Any]:
    """zb-h1 (two stages) and zb-v (four, two per rank) across two ranks: the most earlier
    micro-batches any own unit saw alive, and the rank's gradients."""
    import pipepar.distributed as ppd

    found: dict[str, Any] = {}
    for schedule, split in (
        ("zb-h1", ["blocks.2"]),
        ("zb-v", ["blocks.1", "blocks.2", "blocks.3"]),
    ):
        torch.manual_seed(0)
        model = Net()
        x, y = torch.randn(4 * M, 16), torch.randn(4 * M, 16)
        pipe = ppd.wrap(model, split=split, chunks=M, schedule=schedule, checkpoint="never")
        for _ in range(2):
            for scale in model.scales():
                scale.saved.clear()
            pipe.step(x, target=y, loss_fn=_loss)
        own = [s for s in model.scales() if s.saved]  # the units this rank computes
        grads = {
            k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None
        }
        found[schedule] = ([s.most_alive for s in own], grads)
        pipe.close()
    return found


@pytest.mark.slow
def test_ranks_free_each_micro_batch_after_its_last_backward_action() -> None:
    from tests._ranks import spawn

    ranks = spawn(2, _on_ranks)
    torch.manual_seed(0)
    plain = Net()
    x, y = torch.randn(4 * M, 16), torch.randn(4 * M, 16)
    _loss(plain(x), y).backward()
    want = dict(plain.named_parameters())
    for schedule in ("zb-h1", "zb-v"):
        seen = set()
        for r in (0, 1):
            most, grads = ranks[r][schedule]
            assert most and max(most) <= 3, f"rank {r}, {schedule}: {most}"
            for name, g in grads.items():
                got = torch.from_numpy(g) / 2  # two steps
                torch.testing.assert_close(got, want[name].grad, rtol=1e-5, atol=1e-6)
                seen.add(name)
        assert seen == set(want), f"{schedule}: no rank gave {set(want) - seen}"
