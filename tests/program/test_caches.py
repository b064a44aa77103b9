"""Key-value caches over micro-batches (:mod:`pipepar.batching.caches`): GPT-2, Llama and BERT
with their default configs (``use_cache`` left as it is) give the plain model's outputs, caches
and gradients through a pipe, in train and eval mode; a cache passed in is updated in place."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipepar
from pipepar.batching import caches

transformers = pytest.importorskip("transformers")

RTOL = 1e-5
VOCAB = 128


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert_config(**options: Any) -> Any:
    return transformers.BertConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **options,
    )  # fmt: skip


def bert() -> nn.Module:
    return transformers.BertForMaskedLM(_bert_config())


def bert_model() -> nn.Module:
    return transformers.BertModel(_bert_config())


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "transformer.h.2"),
    "llama": (llama, "model.layers.2"),
    "bert": (bert, "bert.encoder.layer.2"),
    "bert_model": (bert_model, "encoder.layer.2"),
}


def _close(a: Tensor, b: Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = b.abs().max().clamp_min(1e-6)
    err = ((a - b).abs().max() / scale).item()
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def _wrap(name: str, chunks: int) -> tuple[nn.Module, nn.Module]:
    make, split = MODELS[name]
    plain = make()
    pipe = pipepar.wrap(copy.deepcopy(plain), split=[split], devices=["cpu", "cpu"], chunks=chunks)
    return plain, pipe


def _batch(name: str, rows: int, seq: int = 8) -> dict[str, Tensor]:
    ids = torch.randint(1, VOCAB, (rows, seq))
    if name == "bert_model":
        return {"input_ids": ids}
    return {"input_ids": ids, "labels": ids.clone()}


def _loss(name: str, out: Any) -> Tensor:
    if name == "bert_model":
        return out.last_hidden_state.square().mean() + out.pooler_output.mean()
    return out.loss


def _same_cache(a: Any, b: Any, what: str) -> None:
    assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    assert len(a.layers) == len(b.layers)
    for k, (x, y) in enumerate(zip(a.layers, b.layers)):
        _close(x.keys, y.keys, f"{what} layer {k} keys")
        _close(x.values, y.values, f"{what} layer {k} values")


def _same_outputs(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], Tensor):
            _close(b[key].detach(), a[key].detach(), key)
        else:
            _same_cache(b[key], a[key], key)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_default_config_equals_plain(name: str, mode: str, chunks: int) -> None:
    plain, pipe = _wrap(name, chunks)
    plain.train(mode == "train")
    pipe.train(mode == "train")
    batch = _batch(name, rows=5)  # uneven: 3+2, or 2+1+1+1 rows
    expected, got = plain(**batch), pipe(**batch)
    _same_outputs(expected, got)
    _loss(name, expected).backward()
    _loss(name, got).backward()
    grads = dict(plain.named_parameters())
    for pname, p in pipe.named_parameters():
        if grads[pname].grad is None:
            assert p.grad is None, f"{pname} got a gradient the plain model has not"
            continue
        assert p.grad is not None, f"{pname} got no gradient"
        _close(p.grad, grads[pname].grad, f"gradient of {pname}")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_step_with_default_config_equals_plain(name: str) -> None:
    plain, pipe = _wrap(name, chunks=4)
    batch = _batch(name, rows=4)
    loss = pipe.step(**batch)
    expected = plain(**batch).loss
    expected.backward()
    _close(loss, expected.detach(), "loss")
    grads = dict(plain.named_parameters())
    for pname, p in pipe.named_parameters():
        _close(p.grad, grads[pname].grad, f"gradient of {pname}")  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_returned_cache_carries_no_gradient(chunks: int) -> None:
    _, pipe = _wrap("gpt2", chunks)
    out = pipe(**_batch("gpt2", rows=4))
    assert out.logits.requires_grad
    for layer in out.past_key_values.layers:
        assert not layer.keys.requires_grad and not layer.values.requires_grad
    out.loss.backward()  # the gradients still flow through the logits and the loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_a_cache_passed_in_is_updated_in_place(name: str, chunks: int) -> None:
    plain, pipe = _wrap(name, chunks)
    plain.eval()
    pipe.eval()
    ids = torch.randint(1, VOCAB, (5, 6))
    step = torch.randint(1, VOCAB, (5, 1))
    mine = transformers.DynamicCache(config=plain.config)
    theirs = transformers.DynamicCache(config=plain.config)
    with torch.no_grad():
        first = pipe(input_ids=ids, past_key_values=mine)
        plain(input_ids=ids, past_key_values=theirs)
        assert first.past_key_values is mine
        out = pipe(input_ids=step, past_key_values=mine)
        expected = plain(input_ids=step, past_key_values=theirs)
    assert out.past_key_values is mine
    assert mine.get_seq_length() == 7
    _close(out.logits, expected.logits, "logits of the decode step")
    _same_cache(mine, theirs, "cache")


def test_an_encoder_decoder_cache_is_joined_and_updated_in_place() -> None:
    config = _bert_config(is_decoder=True, add_cross_attention=True)
    plain = transformers.BertLMHeadModel(config).eval()
    pipe = pipepar.wrap(
        copy.deepcopy(plain), split=["bert.encoder.layer.2"], devices=["cpu", "cpu"], chunks=2
    ).eval()
    ids, memory = torch.randint(1, VOCAB, (5, 6)), torch.randn(5, 7, 32)
    step = torch.randint(1, VOCAB, (5, 1))
    with torch.no_grad():
        expected = plain(input_ids=ids, encoder_hidden_states=memory)
        got = pipe(input_ids=ids, encoder_hidden_states=memory)
        cache = got.past_key_values
        for part in ("self_attention_cache", "cross_attention_cache"):
            _same_cache(getattr(cache, part), getattr(expected.past_key_values, part), part)
        assert cache.is_updated == expected.past_key_values.is_updated
        expected = plain(input_ids=step, encoder_hidden_states=memory, past_key_values=expected[1])
        got = pipe(input_ids=step, encoder_hidden_states=memory, past_key_values=cache)
    assert got.past_key_values is cache and cache.get_seq_length() == 7
    _close(got.logits, expected.logits, "logits of the decode step")


class _LegacyCached(nn.Module):
    """Takes and returns its cache in the legacy form: a tuple of (keys, values) per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, past: tuple[tuple[Tensor, Tensor], ...]) -> Any:
        new = []
        for layer, (k, v) in zip((self.a, self.b), past):
            x = layer(x)
            k, v = torch.cat([k, x[:, None]], 1), torch.cat([v, -x[:, None]], 1)
            x = x + k.mean(1)
            new.append((k, v))
        return x, tuple(new)


def test_a_legacy_tuple_cache_is_split_and_joined_like_tensors() -> None:
    plain = _LegacyCached()
    pipe = pipepar.wrap(copy.deepcopy(plain), [1, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(5, 4)
    past = tuple((torch.randn(5, 3, 4), torch.randn(5, 3, 4)) for _ in range(2))
    expected, got = plain(x, past), pipe(x, past)
    _close(got[0].detach(), expected[0].detach(), "output")
    for (k, v), (ek, ev) in zip(got[1], expected[1]):
        _close(k.detach(), ek.detach(), "keys")
        _close(v.detach(), ev.detach(), "values")


# -- the module's functions ---------------------------------------------------------------------
def _filled(rows: int, layers: int = 2) -> Any:
    cache = transformers.DynamicCache()
    for k in range(layers):
        cache.update(torch.randn(rows, 2, 3, 4), torch.randn(rows, 2, 3, 4), k)
    return cache


def test_split_gives_row_views_and_join_writes_back_into_the_callers_cache() -> None:
    cache = _filled(5)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    layers = list(cache.layers)
    pieces = caches.split(cache, 5, 2)
    assert [p.layers[0].keys.shape[0] for p in pieces] == [3, 2]
    assert all(p is not cache and p.layers[0] is not cache.layers[0] for p in pieces)
    for piece in pieces:  # what a model does: append a token in every layer
        for k in range(2):
            rows = piece.layers[k].keys.shape[0]
            piece.update(torch.ones(rows, 2, 1, 4), torch.ones(rows, 2, 1, 4), k)
    joined = caches.join(pieces, [3, 2])
    assert joined is cache and list(cache.layers) == layers  # the caller's objects, updated
    assert cache.get_seq_length() == 4
    for layer, (keys, values) in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys[:, :, :3], keys)
        torch.testing.assert_close(layer.values[:, :, :3], values)
        torch.testing.assert_close(layer.values[:, :, 3:], torch.ones(5, 2, 1, 4))
    assert caches.split(cache, 5, 1) == [cache]  # one micro-batch: the cache as it is


def test_a_static_cache_is_updated_in_place_and_keeps_its_tensors() -> None:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=2
    )
    cache = transformers.StaticCache(config=config, max_cache_len=6)
    cache.update(torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8), 0)  # 2 tokens in layer 0
    layer = cache.layers[0]
    keys, length = layer.keys, layer.cumulative_length
    pieces = caches.split(cache, 5, 2)
    assert [p.layers[0].batch_size for p in pieces] == [3, 2]
    for piece in pieces:
        rows = piece.layers[0].batch_size
        piece.update(torch.ones(rows, 2, 1, 8), torch.ones(rows, 2, 1, 8), 0)
    assert int(length) == 2  # each micro-batch advanced a copy of the counter
    assert caches.join(pieces, [3, 2]) is cache
    assert layer.keys is keys and layer.cumulative_length is length and int(length) == 3
    assert layer.batch_size == 5
    torch.testing.assert_close(keys[:, :, 2], torch.ones(5, 2, 8))


def test_join_of_new_caches_makes_one_of_the_same_type() -> None:
    pieces = [_filled(3), _filled(2)]
    joined = caches.join(pieces, [3, 2])
    assert type(joined) is transformers.DynamicCache
    assert joined not in pieces and joined.layers[0] is not pieces[0].layers[0]
    torch.testing.assert_close(
        joined.layers[1].values, torch.cat([p.layers[1].values for p in pieces])
    )
    assert pieces[0].layers[0].keys.shape[0] == 3  # the pieces are left as they were


def test_values_that_differ_beyond_the_rows_are_refused_with_both_values() -> None:
    pieces = [_filled(3), _filled(2)]
    pieces[1].layers[1].keys = pieces[1].layers[1].keys[:, :, :2]  # one token fewer
    with pytest.raises(ValueError, match=r"layers\[1\].keys differs .*\(3, 2, 3, 4\) vs .*"
                       r"\(2, 2, 2, 4\).*chunks=1"):  # fmt: skip
        caches.join(pieces, [3, 2], "output past_key_values")
    pieces = [_filled(3), _filled(2)]
    pieces[1].layers[0].is_initialized = "partly"
    with pytest.raises(ValueError, match=r"is_initialized differs .*True vs 'partly'"):
        caches.join(pieces, [3, 2])


def test_caches_are_recognized_without_importing_transformers_here() -> None:
    assert caches.is_cache(_filled(2))
    assert not caches.is_cache(torch.zeros(2)) and not caches.is_cache(None)
    assert not caches.is_cache(_filled(2).layers[0])
    with open(caches.__file__) as file:
        source = file.read()
    assert "import transformers" not in source and "from transformers" not in source
