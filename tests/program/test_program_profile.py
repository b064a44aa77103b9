"""profile_model: the planner's profile of any model, one LayerProfile per unit.

Memory fields of a meta profile must equal those of a CPU profile of the same model, since both
record the same storages: parameters, gradients and optimizer state are sizes; saved
activations and outputs are the tensors autograd keeps and units return, which a meta trace
sees exactly once attention runs as the fused kernel does. Only the peaks of temporaries may
differ: the CPU allocator also sees kernels' scratch buffers (oneDNN, flash attention), which no
dispatch mode can; the stage peaks planned from either profile agree within 10%.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import pipepar
from models import transformers_zoo as zoo
from pipepar.meta.values import MetaScalars
from pipepar.planner.model_profile import profile_model
from tests._llama70b import llama3_70b_bf16, llama3_70b_profiled

EXACT = (
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "output_bytes",
    "output_shape",
    "name",
)


def test_params_and_grads_are_plain_sums_tied_weight_once() -> None:
    model = zoo.gpt2(layers=2)
    prof = profile_model(model, zoo.sample("gpt2", batch=2, seq=8), device="meta")
    paths = [u.path for u in pipepar.units(model)]
    assert [layer.name for layer in prof.layers] == paths
    by_name = dict(model.named_modules())
    for layer in prof.layers:
        own = sum(p.numel() * 4 for p in by_name[layer.name].parameters())
        if layer.name == "lm_head":  # its weight is the token embedding's: counted there
            assert layer.params_bytes == layer.grads_bytes == 0
        else:
            assert layer.params_bytes == layer.grads_bytes == own
    total = sum(p.numel() * 4 for p in model.parameters())  # each parameter once
    assert prof.total("params_bytes") == prof.total("grads_bytes") == total
    adam = prof.with_optimizer("adam")
    assert adam.total("optimizer_bytes") == 2 * total


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_meta_profile_agrees_with_cpu(name: str) -> None:
    model = zoo.build(name)
    sample = zoo.sample(name, batch=4, seq=16)
    meta = profile_model(model, sample, device="meta", optimizer="adam")
    cpu = profile_model(model, sample, device="cpu", optimizer="adam")
    assert meta.batch_size == cpu.batch_size == 4 and meta.input_bytes == cpu.input_bytes
    for a, b in zip(meta.layers, cpu.layers):
        assert [getattr(a, f) for f in EXACT] == [getattr(b, f) for f in EXACT], a.name
    assert _storages(meta) == _storages(cpu)
    assert meta.layers[0].forward_ms is None and cpu.timed
    options = dict(devices=2, chunks=2, checkpoint="never", optimizer="adam")
    planned = [pipepar.plan(p, **options) for p in (meta, replace_times(cpu))]
    for s, t in zip(*(p.stages for p in planned)):
        assert s.peak_bytes == pytest.approx(t.peak_bytes, rel=0.10)


def _storages(prof: pipepar.Profile) -> list[tuple[int, ...]]:
    """What the planner counts: who made each kept storage, its size, and how far it goes."""
    return sorted(
        (s.creator, s.nbytes, s.saved, -2 if s.last_output is None else s.last_output)
        for s in prof.storages
    )


def replace_times(prof: pipepar.Profile) -> pipepar.Profile:
    """The CPU profile without times, so both plans balance by memory alike."""
    from dataclasses import replace

    return replace(
        prof, layers=[replace(x, forward_ms=None, backward_ms=None) for x in prof.layers]
    )


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_model_profiled_under_no_grad_or_inference_mode_gets_the_training_figures(
    mode: str,
) -> None:
    """Called from an evaluation loop (or with a batch made under ``inference_mode``), the
    profile of a model still measures its training step."""
    model = zoo.gpt2(layers=2)
    expected = profile_model(model, zoo.sample("gpt2", batch=4), device="cpu")
    with getattr(torch, mode)():
        got = profile_model(model, zoo.sample("gpt2", batch=4), device="cpu")
    assert [layer.activation_bytes for layer in got.layers] == [
        layer.activation_bytes for layer in expected.layers
    ]
    assert sum(layer.activation_bytes for layer in got.layers) > 0


def test_attention_counted_as_the_fused_kernel_keeps_it() -> None:
    """Llama's grouped-query attention on meta keeps keys and values at their own heads and
    no T x T probabilities: a block's activations grow linearly with the sequence."""
    model = zoo.llama(layers=2, hidden=64, heads=8, kv_heads=2, intermediate=128)
    short, long = (
        profile_model(model, zoo.sample("llama", batch=2, seq=t, labels=False), device="meta")
        for t in (64, 256)
    )
    block = [x.name for x in short.layers].index("model.layers.0")
    assert long.layers[block].activation_bytes == 4 * short.layers[block].activation_bytes


def test_meta_reads_known_values_and_refuses_unknown_ones() -> None:
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")
    weight = torch.empty(3, device="meta")  # made outside: no value, as a model's weights
    with MetaScalars() as values:
        values.know(ids, torch.ones(2, 8, dtype=torch.long))
        assert bool((ids == 1).all()) and int((ids + 1).sum()) == 32
        assert not bool((ids[:, -1] == 0).any())
        with pytest.raises(ValueError, match="meta tensor of shape"):
            bool(weight.sum() > 0)


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(TypeError, match="sample must hold a tensor"):
        profile_model(nn.Linear(2, 2), {"flag": True}, device="meta")
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        profile_model("gpt2", torch.ones(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device='bogus'"):
        profile_model(nn.Linear(2, 2), torch.ones(2, 2), device="bogus")


def test_llama3_70b_plans_in_seconds_on_meta() -> None:
    profiled = llama3_70b_profiled()  # built and profiled once a session: its seconds kept
    prof, model = profiled.profile, llama3_70b_bf16()
    assert len(prof) == len(pipepar.units(model)) == 84
    start = time.perf_counter()
    layout = dict(devices=8, capacity="80GiB", chunks=8, checkpoint="always", schedule="1f1b")
    plan = pipepar.plan(prof, optimizer="sgd-momentum", **layout)
    took = profiled.seconds + time.perf_counter() - start
    assert took < 60  # about 11-14 s on an idle 2-core machine
    assert len(plan.balance) == 8 and sum(plan.balance) == 84
    assert all(s.fits and s.device_peak_bytes <= 80 * 2**30 for s in plan.stages)
    table = pipepar.report.table(plan)
    assert "model.layers.79" in table and "lm_head" in table
    # Adam's state (bf16 here) brings the weights alone to 66 GiB a device: no split of
    # 4096-token micro-batches fits, and the planner says by how much.
    with pytest.raises(ValueError, match="short by"):
        pipepar.plan(prof, optimizer="adam", **layout)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_wrap_plans_any_model_and_equals_it(name: str) -> None:
    torch.manual_seed(0)
    model = zoo.build(name)
    sample = zoo.sample(name, batch=4, seq=8)
    with torch.no_grad():
        expected = model(**sample)
    pipe = pipepar.wrap(model, devices=["cpu", "cpu"], chunks=2, sample=sample)
    try:
        assert pipe.layout.pp == 2 and sum(pipe.balance) == len(pipepar.units(model))
        with torch.no_grad():
            got = pipe(**sample)
    finally:
        pipe.close()
    for field in ("logits", "loss"):
        if hasattr(expected, field):
            torch.testing.assert_close(getattr(got, field), getattr(expected, field))
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected)
