"""Real models under ``torch.autocast`` on the CPU (bfloat16, float32 weights): a pipe's step
follows the plain model's step under the same autocast, in every schedule, in one process.
Under autocast a Linear computes with a bfloat16 copy of its weight; the split backward's W
makes those weights' gradients directly (no autograd pass, no graph kept for W)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import pipepar
from models import transformers_zoo as zoo
from pipepar.core.named_schedules import VIRTUAL
from tests.program import _real as real
from tests.program._real import SPLITS

RTOL = 3e-2  # bfloat16: a few roundings in another order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_step_under_autocast_follows_the_plain_model(name: str, schedule: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    split = SPLITS[name] if schedule in VIRTUAL else SPLITS[name][1:2]
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=split, devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    batch = zoo.padded_sample(name, batch=8, seq=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(**batch)
        expected = plain(**batch).loss
    expected.backward()
    real._close(loss.detach(), expected.detach().float(), "loss", RTOL)
    real._same_grads(pipe, plain, RTOL)


def _on_ranks(rank: int) -> tuple[float, dict[str, Any]]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build("gpt2")
    pipe = ppd.wrap(model, split=SPLITS["gpt2"], chunks=4, schedule="zb-v")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(**zoo.padded_sample("gpt2", batch=8, seq=12))
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}
    pipe.close()
    return float(loss), grads


@pytest.mark.slow
def test_ranks_under_autocast_follow_the_plain_model() -> None:
    from tests._ranks import spawn

    ranks = spawn(2, _on_ranks)
    torch.manual_seed(0)
    plain = zoo.build("gpt2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(**zoo.padded_sample("gpt2", batch=8, seq=12)).loss
    expected.backward()
    want = dict(plain.named_parameters())
    seen = set()
    for r in (0, 1):
        loss, grads = ranks[r]
        real._close(torch.tensor(loss), expected.detach().float(), f"rank {r}'s loss", RTOL)
        for name, g in grads.items():
            real._close(torch.from_numpy(g), want[name].grad, f"rank {r}: {name}", RTOL)
            seen.add(name)
    assert seen == set(want)


class _Probe(torch.nn.Linear):
    """A Linear that notes where the bf16 copy of its weight, saved for backward, lives."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.copies: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        with torch._C.DisableTorchFunction():  # a look aside, not part of the model's forward
            saved = y.grad_fn._saved_mat2  # type: ignore[union-attr]
            if saved is not None:  # saved where the layer's input needs a gradient
                self.copies.append(saved.untyped_storage().data_ptr())
        return y


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Probe(16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_model_pipe_saves_one_weight_copy_for_every_micro_batch(schedule: str) -> None:
    """Each micro-batch's forward runs on its own thread, where autocast would cast every
    weight anew; the graphs of all micro-batches save one copy per weight, as a plain loop
    under one autocast does, and the gradients are the plain model's."""
    torch.manual_seed(0)
    model = _Stack()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, split=["layers.2"], devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    x, y = torch.randn(16, 16), torch.randn(16, 16)

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((out.float() - t) ** 2).mean()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x, target=y, loss_fn=loss_fn)
    for k in (1, 2, 3):  # layer 0's input needs no gradient: it saves no weight
        found = model.layers[k].copies
        assert len(found) == 4 and len(set(found)) == 1, f"layer {k}: {len(set(found))} copies"
    for a, b in zip(x.split(4), y.split(4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            part = loss_fn(plain(a), b) / 4
        part.backward()
    real._same_grads(pipe, plain, 1e-5)
