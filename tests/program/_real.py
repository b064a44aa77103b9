"""What the tests of real models share: where to split them, a batch for each, a plain step
and a pipe step, gradient comparison, training both side by side, and a count of operations
through the cut's mode."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import transformers_zoo as zoo
from pipepar.program.cut import Cut

RTOL = 1e-5

SPLITS = {  # two stages, and four for the virtual-stage schedules
    "gpt2": ["transformer.h.1", "transformer.h.2", "transformer.h.3"],
    "llama": ["model.layers.1", "model.layers.2", "model.layers.3"],
    "bert": ["bert.encoder.layer.1", "bert.encoder.layer.2", "bert.encoder.layer.3"],
    "vit_timm": ["blocks.1", "blocks.2", "blocks.3"],
    "vit_torchvision": [f"encoder.layers.encoder_layer_{k}" for k in (1, 2, 3)],
}


@contextmanager
def mode_calls() -> Iterator[list[int]]:
    """Counts the operations that pass through the cut's torch-function mode."""
    count = [0]
    original = Cut.__torch_function__

    def counting(self: Cut, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, *args, **kwargs)

    Cut.__torch_function__ = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        Cut.__torch_function__ = original  # type: ignore[method-assign]


def _close(a: Tensor, b: Tensor, what: str, rtol: float = RTOL) -> None:
    """``a`` on ``b``'s device and within ``rtol`` of it, relative to ``b``'s largest value
    (compared in float32, so half-precision results compare too)."""
    assert a.device == b.device, f"{what}: on {a.device}, expected {b.device}"
    scale = b.float().abs().max().clamp_min(1e-6)
    err = ((a.float() - b.float()).abs().max() / scale).item()
    assert err < rtol, f"{what}: relative error {err:.2e}"


def _batch(name: str, seed: int) -> tuple[dict[str, Tensor], Tensor | None]:
    if name.startswith("vit"):
        gen = torch.Generator().manual_seed(seed)
        return zoo.sample(name, batch=4, seed=seed), torch.randint(10, (4,), generator=gen)
    return zoo.padded_sample(name, batch=4, seq=8, seed=seed), None


def _plain_step(model: nn.Module, batch: dict[str, Tensor], y: Tensor | None) -> Tensor:
    loss = F.cross_entropy(model(**batch), y) if y is not None else model(**batch).loss
    loss.backward()
    return loss.detach()


def _pipe_step(pipe: nn.Module, batch: dict[str, Tensor], y: Tensor | None) -> Tensor:
    if y is not None:
        return pipe.step(**batch, loss_fn=F.cross_entropy, target=y)
    return pipe.step(**batch)


def _same_grads(pipe: nn.Module, plain: nn.Module, rtol: float = RTOL) -> None:
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        expected = grads[name].grad
        if expected is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{name} got no gradient"
        _close(p.grad, expected, f"gradient of {name}", rtol)


def ranks_equal_plain(
    got: Iterable[tuple[float, dict[str, Any]]], loss: Tensor, plain: nn.Module
) -> None:
    """Each rank's ``(loss, gradients by name as arrays)`` of a step equals the plain model's
    ``loss`` and gradients, and every weight's gradient is on some rank."""
    grads = dict(plain.named_parameters())
    seen: set[str] = set()
    for r, (got_loss, got_grads) in enumerate(got):
        assert abs(got_loss - loss.item()) <= RTOL * abs(loss.item()), (r, got_loss, loss.item())
        for key, g in got_grads.items():
            ref = grads[key].grad
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"
            seen.add(key)
    assert seen == set(grads), f"no rank holds {set(grads) - seen}"


def sgd_side_by_side(
    pipe: nn.Module, plain: nn.Module, batches: Iterable[dict[str, Tensor]], lr: float = 0.1
) -> None:
    """Train the pipe and the plain model on the same batches with their own SGD, each step
    with the model's own loss."""
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=lr)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=lr)
    for batch in batches:
        pipe.step(**batch)
        plain(**batch).loss.backward()
        for opt in (opt_pipe, opt_plain):
            opt.step()
            opt.zero_grad()


class Skipping(torch.nn.Module):
    """Skips block 1 when ``skip`` is set: the units it runs depend on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            if not (k == 1 and bool(skip[0])):
                x = torch.tanh(block(x))
        return x
