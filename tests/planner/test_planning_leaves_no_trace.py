"""Planning from a sample leaves the model exactly as the user passed it.

Planning runs the model's own forward (the unit order, the profile, the FLOP count, the
``pipe_split()`` markers). A forward stores things on its modules besides buffer values: a
dynamic rotary embedding (transformers' Llama with ``rope_type="dynamic"``) records the length
it grew for and registers a new ``inv_freq`` tensor; a planned pipe that kept those computed
with other frequencies than the plain model. Each test compares with a copy of the model made
before planning.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import pipepar
from pipepar.planner.flop_count import count_flops

_PLAIN = (int, float, bool, str, type(None))


def _dynamic_rope_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=8,  # the sample is longer: the frequencies grow
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


class _Counted(nn.Module):
    """Counts its calls on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layer(x)


class _Cached(nn.Module):
    """Keeps its first input's mean as a plain tensor attribute and adds it ever after."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.offset: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset is None:
            self.offset = x.detach().mean(0)
        return self.layer(x + self.offset)


def _stateful() -> nn.Module:
    return nn.Sequential(_Counted(), nn.ReLU(), _Cached(), nn.ReLU(), nn.Linear(4, 2))


def _looks(model: nn.Module) -> dict[str, Any]:
    """Every module's plain attributes and tensors held as attributes (values), its buffers
    (objects and values), the state dict's values."""
    out: dict[str, Any] = {"state": {k: v.clone() for k, v in model.state_dict().items()}}
    for path, module in model.named_modules():
        out[path] = {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in vars(module).items()
            if isinstance(value, (*_PLAIN, torch.Tensor))
        }
        out[path]["buffers"] = {name: (id(b), b.clone()) for name, b in module._buffers.items()}
        out[path]["keys"] = sorted(vars(module))
    return out


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for x, y in zip(a, b):
            _assert_same(x, y, where)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_dynamic_rope_llama_planned_from_a_long_sample_computes_as_the_plain_model() -> None:
    model = _dynamic_rope_llama()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 24))
    looks = _looks(model)
    pipe = pipepar.wrap(model, sample=dict(input_ids=ids, labels=ids), devices=["cpu", "cpu"])
    _assert_same(looks, _looks(model))
    assert torch.equal(pipe(input_ids=ids).logits, plain(input_ids=ids).logits)
    loss = pipe.step(input_ids=ids, labels=ids)
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_counter_and_a_cache_stay_as_they_were_and_the_pipe_computes_as_the_plain() -> None:
    model = _stateful()
    plain = copy.deepcopy(model)
    looks = _looks(model)
    pipe = pipepar.wrap(model, sample=torch.randn(8, 4), devices=["cpu", "cpu"], chunks=1)
    _assert_same(looks, _looks(model))
    assert model[0].calls == 0 and model[2].offset is None
    x = torch.randn(6, 4)
    assert torch.equal(pipe(x), plain(x))


def test_profile_units_and_the_flop_count_leave_the_model_identical() -> None:
    model = _dynamic_rope_llama()
    sample = dict(input_ids=torch.randint(0, 64, (2, 24)))
    looks = _looks(model)
    assert pipepar.units(model, sample)
    _assert_same(looks, _looks(model))
    prof = pipepar.profile(model, sample, device="cpu")
    _assert_same(looks, _looks(model))
    count_flops(model, sample, pipepar.profile(model, sample, device="meta"))
    _assert_same(looks, _looks(model))
    assert prof.timed and all(p.grad is None for p in model.parameters())


def test_the_sequential_profile_and_the_marker_forward_leave_the_model_identical() -> None:
    from torch.distributed.pipelining import pipe_split

    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = _Counted(), _Cached()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.first(x)
            pipe_split()
            return self.second(x)

    chain = _stateful()
    looks = _looks(chain)
    pipepar.profile(chain, torch.randn(8, 4), device="cpu")
    _assert_same(looks, _looks(chain))
    marked = Marked()
    plain = copy.deepcopy(marked)
    looks = _looks(marked)
    pipe = pipepar.wrap(marked, sample=torch.randn(8, 4), devices=["cpu", "cpu"])
    _assert_same(looks, _looks(marked))
    x = torch.randn(5, 4)
    assert torch.equal(pipe(x), plain(x))
