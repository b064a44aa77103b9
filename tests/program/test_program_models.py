"""Real models as they are (transformers GPT-2, Llama, BERT; timm and torchvision ViT) through
``pipepar.wrap``: outputs, every gradient by name and the parameters after optimizer steps
equal the plain model's, for 2 and 3 stages and 1, 2 and 4 micro-batches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from models import transformers_zoo as zoo
from tests.program._real import _close, sgd_side_by_side

pytest.importorskip("transformers")
pytest.importorskip("timm")


def _split(model: nn.Module, stages: int) -> list[int]:
    n = len(pipepar.units(model))
    base, extra = divmod(n, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _loss(model: nn.Module, name: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    if name.startswith("vit"):
        return out.float().logsumexp(-1).mean()
    return out.loss


@pytest.mark.parametrize("name", zoo.NAMES)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_pipe_equals_plain_model(name: str, stages: int, chunks: int) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    model = copy.deepcopy(plain)
    batch = zoo.sample(name, batch=4)
    pipe = pipepar.wrap(
        model, _split(model, stages), devices=["cpu"] * stages, chunks=chunks, sample=batch
    )
    # SGD: its update is linear in the gradient (Adam divides rounding noise of near-zero
    # gradients by their own size, which says nothing about the pipe)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        loss_pipe = _loss(pipe, name, batch)
        loss_plain = _loss(plain, name, batch)
        _close(loss_pipe.detach(), loss_plain.detach(), "loss")
        loss_pipe.backward()
        loss_plain.backward()
        grads = dict(plain.named_parameters())
        for pname, p in pipe.named_parameters():
            assert p.grad is not None, f"{pname} got no gradient"
            _close(p.grad, grads[pname].grad, f"gradient of {pname}")  # type: ignore[arg-type]
        opt_pipe.step()
        opt_plain.step()
        opt_pipe.zero_grad()
        opt_plain.zero_grad()
    after = dict(plain.named_parameters())
    for pname, p in pipe.named_parameters():
        _close(p.detach(), after[pname].detach(), f"{pname} after two optimizer steps")


@pytest.mark.parametrize("name", ["gpt2", "llama", "vit_timm"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_step_in_schedule_order_equals_plain(name: str, schedule: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    model = copy.deepcopy(plain)
    batch = zoo.sample(name, batch=4)
    pipe = pipepar.wrap(
        model, _split(model, 2), devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    if name.startswith("vit"):
        loss = pipe.step(**batch, loss_fn=lambda out, _: out.float().logsumexp(-1).mean())
    else:
        loss = pipe.step(**batch)
    expected = _loss(plain, name, batch)
    expected.backward()
    _close(loss, expected.detach(), "loss")
    grads = dict(plain.named_parameters())
    for pname, p in pipe.named_parameters():
        _close(p.grad, grads[pname].grad, f"gradient of {pname}")  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_tied_head_computes_with_one_alias_per_step(
    monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    """GPT-2's head uses the embedding's weight, held by the first stage: the last stage
    computes with one alias of it for the whole step, whose gradient is a weight gradient of
    that stage (under zb-h1 computed in W, not in the B the first stage waits for) summed over
    the micro-batches; no micro-batch makes a leaf of its own for it. Gradients equal the
    plain model's."""
    from pipepar.program.step import SegmentStep

    per_call: list[object] = []
    monkeypatch.setattr(SegmentStep, "_add_tied", lambda self, p, g: per_call.append(p))
    after: list[tuple[str, int]] = []

    def told(kind: str, run: Any) -> Any:
        def action(self: SegmentStep, i: int, *args: Any) -> Any:
            out = run(self, i, *args)
            if self.stage.index == 1:
                after.append((kind, len(self.tied)))
            return out

        return action

    monkeypatch.setattr(SegmentStep, "backward", told("B", SegmentStep.backward))
    monkeypatch.setattr(SegmentStep, "weight", told("W", SegmentStep.weight))
    torch.manual_seed(0)
    plain = zoo.gpt2()
    model = copy.deepcopy(plain)
    batch = zoo.sample("gpt2", batch=4)
    pipe = pipepar.wrap(
        model, split=["transformer.h.2"], devices=["cpu", "cpu"], chunks=4, schedule=schedule
    )
    loss = pipe.step(**batch)
    expected = _loss(plain, "gpt2", batch)
    expected.backward()
    _close(loss, expected.detach(), "loss")
    grads = dict(plain.named_parameters())
    for pname, p in pipe.named_parameters():
        _close(p.grad, grads[pname].grad, f"gradient of {pname}")  # type: ignore[arg-type]
    assert per_call == []
    assert after[0] == ("B", 0 if schedule == "zb-h1" else 1), after
    assert after[-1][1] == 1, after


def test_tied_weights_stay_one_tensor_over_twenty_steps() -> None:
    torch.manual_seed(0)
    plain = zoo.gpt2()
    model = copy.deepcopy(plain)
    pipe = pipepar.wrap(model, split=["transformer.h.2"], devices=["cpu", "cpu"], chunks=2)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in pipe.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # listed once
    sgd_side_by_side(pipe, plain, (zoo.sample("gpt2", batch=4, seed=step) for step in range(20)))
    assert model.lm_head.weight is model.transformer.wte.weight
    torch.testing.assert_close(model.lm_head.weight, plain.lm_head.weight, rtol=1e-4, atol=1e-6)


def test_state_dict_uses_the_models_own_names_both_ways() -> None:
    plain = zoo.gpt2()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=["transformer.h.2"], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert "transformer.h.0.attn.c_attn.weight" in pipe.state_dict()
    fresh = zoo.gpt2()
    fresh.load_state_dict(pipe.state_dict())
    pipe.load_state_dict(plain.state_dict())
    batch = zoo.sample("gpt2", batch=2)
    torch.testing.assert_close(pipe(**batch).logits, fresh(**batch).logits)


def test_output_is_the_models_output_type() -> None:
    model = zoo.llama()
    pipe = pipepar.wrap(model, split=["model.layers.2"], devices=["cpu", "cpu"], chunks=2)
    out = pipe(**zoo.sample("llama", batch=4))
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.logits.shape == (4, 16, zoo.VOCAB)
    assert out.loss.dim() == 0
