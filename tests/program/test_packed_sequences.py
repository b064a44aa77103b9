"""A one-row batch of packed documents (transformers' DataCollatorWithFlattening layout) cut at
document boundaries into micro-batches of balanced tokens: a tiny Llama's loss, logits and
gradients equal the plain model on the same packed batch; labels crossing a cut and models that
let documents see each other are refused before any step."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar
from pipepar.batching.calls import split_call
from pipepar.batching.documents import balanced, lengths_of
from pipepar.batching.rules import Rules
from pipepar.core.document_mixing import DocumentsMixed

transformers = pytest.importorskip("transformers")

VOCAB = 64
LENGTHS = (5, 9, 3, 7, 4, 6)  # six documents, 34 tokens


def llama(**options: Any) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, **options,
    )  # fmt: skip
    config._attn_implementation = options.pop("attn", "sdpa")
    return transformers.LlamaForCausalLM(config).eval().train()


def packed(lengths: tuple[int, ...] = LENGTHS, varlen: bool = False) -> dict[str, Any]:
    """One row made by transformers' DataCollatorWithFlattening: the documents one after
    another, positions restarting at 0, each document's first label ignored; with ``varlen``
    also flash-attention's offsets and longest lengths."""
    g = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=varlen)
    return dict(collate(docs))


def pipe_of(model: nn.Module, chunks: int, **kwargs: Any) -> pipepar.Pipe:
    return pipepar.wrap(model, balance=[3, 3, 2], devices=["cpu"] * 3, chunks=chunks, **kwargs)


def tokens_seen(model: nn.Module) -> list[int]:
    """The tokens of each micro-batch the model's embedding is called on (filled as it runs)."""
    seen: list[int] = []
    embed = model.get_input_embeddings()
    embed.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    return seen


CUTS = {2: [17, 17], 3: [14, 10, 10]}  # LENGTHS in balanced runs of whole documents


def assert_grads_equal(model: nn.Module, plain: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


# -- the cut ------------------------------------------------------------------------------------
def test_balanced_runs_of_whole_documents() -> None:
    assert balanced([5, 9, 3, 7, 4, 6], 2) == [range(0, 3), range(3, 6)]  # 17 | 17
    assert balanced([5, 9, 3, 7, 4, 6], 3) == [range(0, 2), range(2, 4), range(4, 6)]  # 14|10|10
    assert balanced([30, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 4)]  # each keeps one
    assert balanced([4, 4], 5) == [range(0, 1), range(1, 2)]  # no more runs than documents


def test_layouts_recognised_from_values() -> None:
    assert lengths_of(torch.tensor([[0, 1, 2, 0, 1, 0]])) == ("positions", (3, 2, 1))
    assert lengths_of(torch.tensor([0, 3, 5, 6], dtype=torch.int32)) == ("offsets", (3, 2, 1))
    assert lengths_of(torch.tensor([[0, 1, 2, 3]])) is None  # one document
    assert lengths_of(torch.zeros(1, 5, dtype=torch.long)) is None  # token types, not positions
    assert lengths_of(torch.tensor([[3, 4, 0, 1]])) is None  # does not start at 0
    assert lengths_of(torch.tensor([[0, 1, 5, 6]])) is None  # a jump that is not a restart


def test_split_cuts_every_per_token_argument_and_rebases_offsets() -> None:
    batch = packed()
    call = {**packed(varlen=True), "flag": 3}
    calls = split_call((), call, 3)
    assert [c.kwargs["max_length_q"] for c in calls] == [9, 9, 9]  # an int is not guessed at
    longest = Rules.given({"max_length_q": pipepar.Documents()}, None)
    calls = split_call((), call, 3, longest)
    assert [c.rows for c in calls] == [14, 10, 10]
    assert [c.kwargs["cu_seq_lens_q"].tolist() for c in calls] == [
        [0, 5, 14],
        [0, 3, 10],
        [0, 4, 10],
    ]
    assert [c.kwargs["max_length_q"] for c in calls] == [9, 7, 6]
    assert [c.kwargs["flag"] for c in calls] == [3, 3, 3]
    torch.testing.assert_close(
        torch.cat([c.kwargs["input_ids"] for c in calls], 1), batch["input_ids"]
    )
    assert calls[1].kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]
    assert [c.kwargs["cu_seq_lens_k"].tolist() for c in calls][1] == [0, 3, 10]
    several_rows = {k: v.expand(2, -1) for k, v in batch.items()}
    assert [c.rows for c in split_call((), several_rows, 3)] == [1, 1]  # rows: cut by rows
    rows = Rules.given({"position_ids": "rows"}, None)
    assert len(split_call((), batch, 3, rows)) == 1  # said to be rows: one row


# -- equal to the plain model -------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_step_equals_the_plain_model(schedule: str, chunks: int) -> None:
    model, batch = llama(), packed()
    plain = copy.deepcopy(model)
    seen = tokens_seen(model)
    loss = pipe_of(model, chunks, schedule=schedule).step(**batch)
    assert sorted(seen[-chunks:], reverse=True) == CUTS[chunks]
    ref = plain(**batch).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_equal(model, plain)


def test_call_logits_loss_and_backward_equal_the_plain_model() -> None:
    model, batch = llama(), packed()
    plain = copy.deepcopy(model)
    seen = tokens_seen(model)
    pipe = pipe_of(model, 3)
    out, ref = pipe(**batch), plain(**batch)
    assert seen == CUTS[3]
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    (out.loss + out.logits.square().mean()).backward()
    (ref.loss + ref.logits.square().mean()).backward()
    assert_grads_equal(model, plain)
    with torch.no_grad():  # evaluation: the same cut, no graph
        torch.testing.assert_close(pipe(**batch).logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_eager_attention_and_declared_positions() -> None:
    model, batch = llama(attn="eager"), packed()
    plain = copy.deepcopy(model)
    pipe = pipe_of(model, 2, split_inputs={"position_ids": pipepar.Documents()})
    loss = pipe.step(**batch)
    ref = plain(**batch).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_equal(model, plain)


# -- refused before any step --------------------------------------------------------------------
def test_labels_crossing_a_cut_are_refused() -> None:
    model, batch = llama(), packed()
    batch["labels"] = batch["input_ids"].clone()  # each document's last token predicts the next
    with pytest.raises(pipepar.LossNotJoinable, match="lies across a cut between documents"):
        pipe_of(model, 2).step(**batch)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mixing", ["attention_mask", "use_cache"])
def test_a_model_that_lets_documents_see_each_other_is_refused(mixing: str) -> None:
    model, batch = llama(), packed()
    if mixing == "attention_mask":  # given a mask, transformers does not read the positions
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    else:  # with a cache, it does not either
        batch["use_cache"] = True
    with pytest.raises(DocumentsMixed, match="lets packed documents see each other"):
        pipe_of(model, 2).step(**batch)
    assert all(p.grad is None for p in model.parameters())


class CausalAttention(nn.Module):
    """Absolute positions and plain causal attention: documents see the ones before them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, 16), nn.Embedding(16, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 48) for _ in range(3))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, position_ids, labels):
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            q, k, v = block(x)[:, None].chunk(3, -1)
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        logits = self.head(x)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def test_a_model_of_other_code_mixing_documents_is_refused() -> None:
    torch.manual_seed(0)
    pipe = pipepar.wrap(CausalAttention(), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(DocumentsMixed, match="is_causal=True without a mask"):
        pipe.step(**packed())


def test_flash_attention_kwargs_are_cut_and_the_step_equals_the_plain_model() -> None:
    model, batch = llama(), packed(varlen=True)  # cu_seq_lens_q/k, max_length_q/k: sdpa
    assert batch["max_length_q"] == 9  # reads none of them
    plain = copy.deepcopy(model)
    seen = tokens_seen(model)
    loss = pipe_of(model, 3).step(**batch)
    assert seen == CUTS[3]
    ref = plain(**batch).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_equal(model, plain)


def test_a_kind_learned_under_a_row_cut_is_watched_again_under_a_document_cut() -> None:
    pipe = pipe_of(llama(), 2)
    rows = {k: v.reshape(2, 17) for k, v in packed().items()}
    rows["position_ids"] = torch.arange(17).expand(2, 17)
    rows["attention_mask"] = torch.ones(2, 17, dtype=torch.long)
    pipe.step(**rows)  # micro-batches of one row of 17 tokens: rows never mix here
    mixed = {**packed(), "attention_mask": torch.ones(1, 34, dtype=torch.long)}
    with pytest.raises(DocumentsMixed):  # micro-batches of the same shapes, documents mixed
        pipe.step(**mixed)


def test_a_loss_fn_with_a_target_is_refused_under_a_document_cut() -> None:
    batch = packed()
    labels = batch.pop("labels")
    with pytest.raises(ValueError, match="a target is cut by rows only"):
        pipe_of(llama(), 2).step(**batch, loss_fn=lambda out, y: out.logits.mean(), target=labels)


class PackedAttention(nn.Module):
    """Its own block-diagonal causal mask from restarting positions, and a loss averaged over
    every element of what it computes (a count no input replays: one per token, scaled)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 48) for _ in range(3))
        self.head = nn.Linear(16, 8)

    def forward(self, input_ids, position_ids):
        document = (position_ids == 0).cumsum(-1)
        same = document[..., :, None] == document[..., None, :]
        mask = (same & torch.ones_like(same).tril())[:, None]
        x = self.embed(input_ids)
        for block in self.blocks:
            q, k, v = block(x)[:, None].chunk(3, -1)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, 0]
        out = self.head(x)
        return {"out": out, "loss": out.square().mean()}


def test_a_mean_over_computed_tokens_is_joined_by_tokens() -> None:
    torch.manual_seed(0)
    model, batch = PackedAttention(), packed()
    del batch["labels"]
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, balance=[2, 3], devices=["cpu"] * 2, chunks=3)
    loss = pipe.step(**batch)
    ref = plain(**batch)["loss"]
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_equal(model, plain)


def test_a_count_the_probe_cannot_replay_scales_with_the_tokens() -> None:
    from pipepar.core.reductions import Probe

    computed = torch.randn(1, 14, 8)  # made where the probe saw nothing: not replayable
    with Probe([], rows=14, rows_dim=1) as probe:
        loss = computed.mean()
    count = probe.form_of(loss).count
    assert [count([], tokens) for tokens in (14, 10)] == [14 * 8, 10 * 8]
    with Probe([], rows=14) as probe:  # rows on dimension 0: a count for this shape only
        loss = computed.mean()
    assert not probe.form_of(loss).count.any_rows


@pytest.mark.parametrize("crossing", [False, True])
def test_a_loss_summed_over_the_batchs_items_is_checked_by_its_real_targets(crossing: bool) -> None:
    model, batch = llama(), packed()
    if crossing:
        batch["labels"] = batch["input_ids"].clone()
    items = (batch["labels"][:, 1:] != -100).sum()  # what HF Trainer passes: the batch's count
    batch["num_items_in_batch"] = items
    plain = copy.deepcopy(model)
    pipe = pipe_of(model, 3)
    if crossing:
        with pytest.raises(pipepar.LossNotJoinable, match="sums over the real targets"):
            pipe.step(**batch)
        return
    loss = pipe.step(**batch)
    ref = plain(**batch).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_equal(model, plain)


def test_declared_and_disagreeing_layouts_name_the_arguments() -> None:
    batch = packed(varlen=True)
    bad = Rules.given({"labels": pipepar.Documents()}, None)
    with pytest.raises(ValueError, match="argument 'labels' delimits documents, but it is"):
        split_call((), batch, 2, bad)
    other = {**batch, "cu_seq_lens_q": torch.tensor([0, 5, 34], dtype=torch.int32)}
    with pytest.raises(ValueError, match="'position_ids' and 'cu_seq_lens_q' delimit different"):
        split_call((), other, 2)
    said = Rules.given({"cu_seq_lens_q": pipepar.Documents()}, None)
    with pytest.raises(ValueError, match="give 'position_ids' a rule of its own"):
        split_call((), other, 2, said)  # a declared one does not hand the others whole
    said = Rules.given({"position_ids": pipepar.Documents()}, None)  # the others agree
    calls = split_call((), batch, 2, said)
    assert [c.kwargs["cu_seq_lens_k"].tolist() for c in calls] == [[0, 5, 14, 17], [0, 7, 11, 17]]
