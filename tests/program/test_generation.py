"""``pipe.generate`` (:mod:`pipepar.hf.generation`): the model's own greedy generation,
every forward call of its loop run by the pipe, gives the plain model's tokens exactly."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipepar
from pipepar.program import driver

transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW = 8


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": (gpt2, "transformer.h.2"), "llama": (llama, "model.layers.2")}


def _wrap(name: str, chunks: int) -> tuple[nn.Module, Any]:
    make, split = MODELS[name]
    plain = make().eval()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=[split], devices=["cpu", "cpu"], chunks=chunks)
    return plain, pipe.eval()


def _prompts(rows: int, padded: bool) -> dict[str, Tensor]:
    ids = torch.randint(1, VOCAB, (rows, 6))
    if not padded:
        return {"input_ids": ids}
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : r % 3] = 0  # left padding of 0, 1 or 2 tokens
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_equals_plain(name: str, chunks: int, padded: bool) -> None:
    plain, pipe = _wrap(name, chunks)
    prompts = _prompts(4, padded)
    expected = plain.generate(**prompts, max_new_tokens=NEW, do_sample=False)
    got = pipe.generate(**prompts, max_new_tokens=NEW, do_sample=False)
    assert got.shape == (4, 6 + NEW)
    assert torch.equal(got, expected)


def test_an_uneven_batch_generates_as_plain() -> None:
    plain, pipe = _wrap("llama", chunks=2)
    prompts = _prompts(5, padded=True)
    expected = plain.generate(**prompts, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(pipe.generate(**prompts, max_new_tokens=NEW, do_sample=False), expected)


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_static_cache_generates_as_plain(chunks: int) -> None:
    plain, pipe = _wrap("llama", chunks)
    prompts = _prompts(5, padded=True)
    options: dict[str, Any] = {"max_new_tokens": NEW, "do_sample": False}
    options.update(cache_implementation="static", return_dict_in_generate=True)
    expected = plain.generate(**prompts, **options)
    got = pipe.generate(**prompts, **options)
    assert torch.equal(got.sequences, expected.sequences)
    layer = got.past_key_values.layers[3]  # the micro-batches wrote into the caller's tensors
    assert layer.batch_size == 5 and int(layer.cumulative_length) == 6 + NEW - 1
    torch.testing.assert_close(layer.keys, expected.past_key_values.layers[3].keys)


def test_every_forward_of_the_loop_goes_through_the_pipe() -> None:
    _, pipe = _wrap("gpt2", chunks=2)
    calls: list[str] = []
    pipe.register_forward_pre_hook(lambda module, args: calls.append("pipe"))
    model = pipe.module
    model.register_forward_pre_hook(
        lambda module, args: calls.append("micro-batch" if driver.active() else "routed")
    )
    out = pipe.generate(**_prompts(4, padded=True), max_new_tokens=NEW, do_sample=False)
    assert out.shape == (4, 6 + NEW)
    # each of the NEW forwards (the prompt, then a token at a time): the model is called by
    # the loop, hands the call to the pipe, which calls the model on each of 2 micro-batches
    assert calls == ["routed", "pipe", "micro-batch", "micro-batch"] * NEW


def test_the_model_is_restored_afterwards_also_on_error() -> None:
    plain, pipe = _wrap("gpt2", chunks=2)
    model = pipe.module
    pipe.generate(**_prompts(4, padded=False), max_new_tokens=2, do_sample=False)
    assert "forward" not in model.__dict__
    bad = torch.full((4, 6), VOCAB + 5)  # no such token: the embedding fails in the pipe
    with pytest.raises(IndexError):
        pipe.generate(input_ids=bad, max_new_tokens=2, do_sample=False)
    assert "forward" not in model.__dict__
    prompts = _prompts(4, padded=False)
    torch.testing.assert_close(model(**prompts).logits, plain(**prompts).logits)


def test_a_forward_the_instance_had_is_kept() -> None:
    plain, pipe = _wrap("gpt2", chunks=2)
    model = pipe.module
    own = model.forward  # a bound method set on the instance, as some libraries do
    model.forward = own
    prompts = _prompts(4, padded=False)
    expected = plain.generate(**prompts, max_new_tokens=2, do_sample=False)
    assert torch.equal(pipe.generate(**prompts, max_new_tokens=2, do_sample=False), expected)
    assert model.__dict__["forward"] is own


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_a_model_without_generate_is_refused() -> None:
    pipe = pipepar.wrap(_Plain(), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"_Plain has none; wrap a transformers language"):
        pipe.generate(torch.zeros(2, 2))
