"""A ModelPipe in HF ``Trainer`` and ``accelerate``, unchanged (pipepar.program.pipe, .hf):
training equals the plain model's; the pipe shows the model's signature and attributes;
``to``/``cuda``/``cpu`` are no-ops where nothing moves; ``hf_device_map`` says where it sits."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from models import transformers_zoo as zoo
from pipepar.hf import conventions as hf

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

SPLIT = ["transformer.h.2"]
CPU2 = ["cpu", "cpu"]
VOCAB, SEQ = 64, 12


def _gpt2() -> nn.Module:
    return zoo.gpt2(layers=4, hidden=32, heads=2, vocab=VOCAB, positions=SEQ)


class _Padded(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token rows right-padded to SEQ (labels -100 on padding), with a column the model does
    not take (``row``): Trainer must drop it and keep the others, as it does for the model."""

    def __init__(self, n: int, *, padded: bool = True) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
        lengths = torch.randint(3, SEQ + 1, (n,), generator=gen) if padded else [SEQ] * n
        self.mask = torch.stack([torch.arange(SEQ) < k for k in lengths]).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": labels,
            "row": i,
        }


def _arguments(out: Path, **options: Any) -> Any:
    # Defaults but for a CPU box: no reporting; save_strategy="no" because Trainer saves a
    # model that is not a PreTrainedModel with safetensors, which refuses tied weights (GPT-2).
    defaults = {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1}
    options = defaults | {"save_strategy": "no"} | options
    return transformers.TrainingArguments(
        output_dir=str(out), report_to="none", disable_tqdm=True, **options
    )


def _train(model: nn.Module, out: Path, **options: Any) -> tuple[list[dict[str, Any]], Any]:
    trainer = transformers.Trainer(
        model=model, args=_arguments(out, **options), train_dataset=_Padded(32)
    )
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e], trainer


# -- training --------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [1, 4])
def test_trainer_trains_the_pipe_as_the_plain_model(tmp_path: Path, chunks: int) -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2, chunks=chunks)
    theirs, _ = _train(plain, tmp_path / "plain", gradient_accumulation_steps=2)
    ours, _ = _train(pipe, tmp_path / "pipe", gradient_accumulation_steps=2)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a["step"])
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    pipe.close()


def test_trainer_evaluates_and_predicts_as_the_plain_model(tmp_path: Path) -> None:
    """Evaluation between steps and ``predict`` (eval batches of 5 rows, the last of 2 for 4
    chunks) give the plain model's losses and logits, and the training around them stays the
    plain model's."""
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2, chunks=4, schedule="1f1b")
    runs = []
    for run, which in (("plain", plain), ("pipe", pipe)):
        trainer = transformers.Trainer(
            model=which,
            args=_arguments(
                tmp_path / run,
                eval_strategy="steps",
                eval_steps=2,
                per_device_eval_batch_size=5,
                gradient_accumulation_steps=2,
                max_grad_norm=1.0,
            ),
            train_dataset=_Padded(32),
            eval_dataset=_Padded(12),
        )
        trainer.train()
        logged = [
            (e["step"], e.get("loss", 0.0), e.get("eval_loss")) for e in trainer.state.log_history
        ]
        runs.append((logged, trainer.predict(_Padded(12)).predictions))
    (theirs, their_logits), (ours, our_logits) = runs
    assert [s for s, _, e in ours if e is not None] == [2, 4]
    assert len(ours) == len(theirs)
    for (step, loss, eval_loss), (_, plain_loss, plain_eval) in zip(ours, theirs):
        assert loss == pytest.approx(plain_loss, rel=1e-5), step
        assert (eval_loss is None) == (plain_eval is None), step
        assert eval_loss is None or eval_loss == pytest.approx(plain_eval, rel=1e-5), step
    ours_p, theirs_p = (p[0] if isinstance(p, tuple) else p for p in (our_logits, their_logits))
    assert ours_p.shape == (12, SEQ, VOCAB)
    torch.testing.assert_close(torch.as_tensor(ours_p), torch.as_tensor(theirs_p))
    pipe.close()


def test_trainer_checkpoints_an_untied_pipe_and_save_pretrained_any(tmp_path: Path) -> None:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    pipe = pipepar.wrap(
        transformers.GPT2LMHeadModel(config), split=["transformer.h.1"], devices=CPU2
    )
    trainer = transformers.Trainer(
        model=pipe,
        args=_arguments(tmp_path, max_steps=1, save_strategy="steps"),  # the default
        train_dataset=_Padded(4),
    )
    trainer.train()
    saved = safetensors_torch.load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    torch.testing.assert_close(saved, pipe.state_dict())
    tied = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2)
    tied.save_pretrained(tmp_path / "tied")  # the model's own, through the attribute fallback
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tied")
    torch.testing.assert_close(loaded.state_dict(), tied.state_dict())


def test_trainer_reads_the_models_signature_and_attributes(tmp_path: Path) -> None:
    model = _gpt2()
    plain = transformers.Trainer(model=copy.deepcopy(model), args=_arguments(tmp_path / "a"))
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2, chunks=2)
    ours = transformers.Trainer(model=pipe, args=_arguments(tmp_path / "b"))
    assert ours.model is pipe
    assert ours.label_names == plain.label_names == ["labels"]
    for what in ("model_accepts_loss_kwargs", "can_return_loss", "_loss_shifts_labels"):
        assert getattr(ours, what) == getattr(plain, what), what
    assert not ours.is_model_parallel  # one device: the CPU
    ours._set_signature_columns_if_needed()
    plain._set_signature_columns_if_needed()
    assert ours._signature_columns == plain._signature_columns
    assert "input_ids" in ours._signature_columns


def _bare_lora(model: nn.Module) -> nn.Module:
    """A LoRA adapter without a task type: PEFT's ``PeftModel``, whose ``forward`` takes only
    ``*args, **kwargs`` and passes them to the model it wraps."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_trainer_trains_a_pipe_of_a_model_that_passes_its_call_on(tmp_path: Path) -> None:
    """Trainer reads the pipe of a wrapper whose ``forward`` is ``(*args, **kwargs)`` as it
    reads the wrapper (through to the model that takes the call): the same dataset columns,
    labels and loss conventions, and the same training; with the wrapper's own signature it
    dropped every column ("The batch received was empty")."""
    torch.manual_seed(0)
    model = _bare_lora(_gpt2())
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=["base_model.model.transformer.h.2"], devices=CPU2, chunks=2)
    trainers = []
    for run, which in (("plain", plain), ("pipe", pipe)):
        trainers.append(transformers.Trainer(model=which, args=_arguments(tmp_path / run)))
        trainers[-1]._set_signature_columns_if_needed()
    theirs, ours = trainers
    assert ours._signature_columns == theirs._signature_columns
    for what in (
        "label_names",
        "model_accepts_loss_kwargs",
        "can_return_loss",
        "_loss_shifts_labels",
    ):
        assert getattr(ours, what) == getattr(theirs, what), what
    assert pipe._get_name() == plain.get_base_model()._get_name()  # label smoothing reads it
    theirs_log, _ = _train(plain, tmp_path / "plain", max_steps=2)
    ours_log, _ = _train(pipe, tmp_path / "pipe", max_steps=2)
    assert [e["loss"] for e in ours_log] == pytest.approx([e["loss"] for e in theirs_log], rel=1e-5)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    make, args, _ = pipe.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # the class found again
    assert type(pickle.loads(pickle.dumps(make(*args)))) is type(pipe)
    pipe.close()


def test_accelerate_prepares_the_pipe_and_a_step_equals_the_plain_models() -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2, chunks=2)
    accelerator = accelerate.Accelerator(cpu=True)
    prepared, opt = accelerator.prepare(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3))
    assert prepared is pipe and accelerator.unwrap_model(prepared) is pipe
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    data = _Padded(8, padded=False)
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    loss = prepared(**batch).loss
    accelerator.backward(loss)
    opt.step()
    expected = plain(**batch).loss
    expected.backward()
    plain_opt.step()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    pipe.close()


# -- to / cuda / cpu ---------------------------------------------------------------------------
def test_moving_a_model_pipe_to_where_it_is_does_nothing() -> None:
    pipe = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2)
    weight = pipe.lm_head.weight
    assert pipe.to("cpu") is pipe
    assert pipe.to(torch.device("cpu")) is pipe
    assert pipe.to(torch.device("cpu", 0)) is pipe  # accelerate under torchrun says cpu:0
    assert pipe.to(device="cpu", non_blocking=True) is pipe
    assert pipe.cpu() is pipe
    assert pipe.lm_head.weight is weight
    assert pipe.to("cpu", torch.float64) is pipe  # to(dtype) converts as before
    assert weight.dtype == torch.float64
    assert pipe(input_ids=torch.randint(0, VOCAB, (2, 5))).logits.dtype == torch.float64


@pytest.mark.parametrize(
    ("call", "move"),
    [
        ("to(device)", lambda pipe: pipe.to("meta")),
        ("to(device)", lambda pipe: pipe.to(torch.empty(0, device="meta"))),
        ("cuda()", lambda pipe: pipe.cuda()),
    ],
)
def test_moving_a_model_pipe_elsewhere_is_refused(call: str, move: Any) -> None:
    pipe = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2)
    with pytest.raises(ValueError, match="places its stages itself") as error:
        move(pipe)
    assert f"pipe.{call}" in str(error.value)
    assert "['cpu', 'cpu']" in str(error.value) and "devices=[...]" in str(error.value)
    assert all(p.device.type == "cpu" for p in pipe.parameters())


# -- looking like the model ----------------------------------------------------------------------
def test_forward_shows_the_models_signature_on_the_class_and_the_instance() -> None:
    model = _gpt2()
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2)
    assert inspect.signature(type(pipe).forward) == inspect.signature(type(model).forward)
    assert inspect.signature(pipe.forward) == inspect.signature(model.forward)
    assert transformers.utils.generic.find_labels(type(pipe)) == ["labels"]
    assert type(pipe).__name__ == type(model).__name__  # transformers reads class names
    assert isinstance(pipe, pipepar.ModelPipe)
    again = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2)
    assert type(again) is type(pipe)  # one class per model class
    assert type(pipepar.ModelPipe(nn.Linear(2, 2), [1])) is not type(pipe)


def test_deepcopy_keeps_the_class_and_the_results() -> None:
    pipe = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2, chunks=2)
    twin = copy.deepcopy(pipe)
    assert type(twin) is type(pipe)
    assert twin.module is not pipe.module and twin.transformer is twin.module.transformer
    assert twin.lm_head.weight is twin.transformer.wte.weight  # still tied
    ids = torch.randint(0, VOCAB, (4, 6))
    torch.testing.assert_close(twin(input_ids=ids).logits, pipe(input_ids=ids).logits)


def test_pickling_finds_the_class_made_for_the_model() -> None:
    pipe = pipepar.wrap(_gpt2(), split=SPLIT, devices=CPU2)
    make, args, _ = pipe.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    assert type(pickle.loads(pickle.dumps(make(*args)))) is type(pipe)


def test_attributes_the_pipe_lacks_are_the_models() -> None:
    model = _gpt2()
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2)
    assert pipe.config is model.config
    assert pipe.main_input_name == "input_ids"
    assert pipe.loss_type == model.loss_type
    assert pipe._no_split_modules == model._no_split_modules
    assert pipe.get_input_embeddings() is pipe.transformer.wte
    assert pipe.num_parameters() == model.num_parameters()
    assert pipe.can_generate() == model.can_generate()
    assert pipe.generation_config is model.generation_config
    assert not hasattr(model, "hf_device_map")  # the pipe's own attributes come first
    assert hasattr(pipe, "hf_device_map")
    with pytest.raises(AttributeError, match="neither has the wrapped GPT2LMHeadModel"):
        _ = pipe.no_such_thing
    with pytest.raises(AttributeError):
        _ = pipe.__no_such_dunder__


# -- where the pipe sits -------------------------------------------------------------------------
def test_hf_device_map_lists_every_unit_on_its_stage_device() -> None:
    model = _gpt2()
    paths = [u.path for u in pipepar.units(model)]
    pipe = pipepar.wrap(model, split=SPLIT, devices=CPU2)
    assert pipe.hf_device_map == dict.fromkeys(paths, "cpu")
    assert pipe.is_parallelizable is False and pipe.model_parallel is False


def test_device_map_writes_cuda_by_index_and_spans_devices() -> None:
    cuda0, cuda1, cpu = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
    assert hf.device_map(["a", "b", "c"], [cuda0, cuda1, cpu]) == {"a": 0, "b": 1, "c": "cpu"}
    assert hf.spans_devices([cuda0, cuda1]) and not hf.spans_devices([cpu, cpu])
    with pytest.raises(ValueError, match="one device per unit"):
        hf.device_map(["a"], [cpu, cpu])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_trainer_sees_a_pipe_over_two_gpus_as_model_parallel(tmp_path: Path) -> None:
    pipe = pipepar.wrap(_gpt2(), split=SPLIT, devices=["cuda:0", "cuda:1"])
    assert pipe.is_parallelizable and pipe.model_parallel
    trainer = transformers.Trainer(model=pipe, args=_arguments(tmp_path))
    assert trainer.is_model_parallel and trainer.args.n_gpu == 1
    assert {p.device for p in pipe.parameters()} == {torch.device(d) for d in ("cuda:0", "cuda:1")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_leaves_a_pipe_on_one_gpu_where_it_is(tmp_path: Path) -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, split=SPLIT, devices=["cuda:0", "cuda:0"], chunks=1)
    assert pipe.to("cuda") is pipe and pipe.cuda(0) is pipe
    with pytest.raises(ValueError, match="places its stages itself"):
        pipe.cpu()
    ours, _ = _train(pipe, tmp_path / "pipe", max_steps=2)
    theirs, _ = _train(plain.cuda(), tmp_path / "plain", max_steps=2)
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
