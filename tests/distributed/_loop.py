"""Whole training loops, run the same way on the plain model, a one-process pipe and the ranks
of a ``pipepar.distributed`` pipe (spawned ranks, or torchrun: see ``_multinode_main.py``).

Each case trains a small transformers GPT-2 (embedding and head tied across the two stages)
for a few optimizer steps the way real loops do: padded batches whose sequence length changes
from step to step, gradients accumulated over two ``step`` calls, clipped by the whole model's
norm, an evaluation between steps, frozen (tied) weights, LoRA adapters, a batch smaller than
``chunks``. It returns the losses, norms and final weights, which the tests compare with the
plain model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from models import transformers_zoo as zoo

CASES = ("clip_accumulate", "frozen_tied", "small_batch", "eval_between", "lora", "autocast")
TOLERANCE = {"autocast": 2e-2}  # bf16 rounds differently on a micro-batch than on the batch
SPLIT = "transformer.h.2"
CHUNKS = 4
STEPS = 3
LR = 0.1


def installed() -> list[str]:
    """The cases this environment can run (``lora`` needs peft)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return [c for c in CASES if c != "lora"]
    return list(CASES)


def settle() -> None:
    """Import what the cases build (transformers' GPT-2, peft where installed) and leave it to
    the collector's permanent generation: a full collection (each pipe's close runs one) then
    walks only what the cases made, not every module."""
    import gc

    from transformers import GPT2LMHeadModel  # noqa: F401

    with contextlib.suppress(ImportError):
        import peft  # noqa: F401
    gc.freeze()


def build(case: str) -> nn.Module:
    """The case's model, the same on every process (seeded)."""
    torch.manual_seed(0)
    model = zoo.gpt2()
    if case == "frozen_tied":
        model.transformer.wte.weight.requires_grad_(False)  # the head's weight too: tied
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False
        )
        model = get_peft_model(model, config)
    return model


def split_path(case: str) -> str:
    return f"base_model.model.{SPLIT}" if case == "lora" else SPLIT


def batch(case: str, step: int, *, replica: int = 0, dp: int = 1, part: int = 0) -> dict[str, Any]:
    """Training batch ``part`` of optimizer step ``step``, this replica's rows of it."""
    rows = 3 if case == "small_batch" else 8  # 3 rows: fewer than chunks, uneven over replicas
    seq = (12, 9, 14)[(step + part) % 3]  # the sequence length changes from call to call
    whole = zoo.padded_sample("gpt2", batch=rows, seq=seq, seed=10 * step + part)
    return {k: v.chunk(dp)[replica] for k, v in whole.items()}


class Plain:
    """The loop's operations on the plain model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def step(self, b: dict[str, Any]) -> float:
        loss = self.model(**b).loss
        loss.backward()
        return float(loss.detach())

    def clip(self, max_norm: float, norm_type: float) -> float:
        params = self.model.parameters()
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))

    def evaluate(self, b: dict[str, Any]) -> float:
        with _eval(self.model), torch.no_grad():
            return float(self.model(**b).loss)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def output_dtype(self, b: dict[str, Any]) -> str | None:
        """The dtype of the logits (None on a rank that does not compute the last stage)."""
        with torch.no_grad():
            out = self.model(**b)
        return None if out is None else str(out.logits.dtype)


class Piped(Plain):
    """The same on a pipe (one process or a rank): its ``step`` and ``clip_grad_norm_``."""

    def step(self, b: dict[str, Any]) -> float:
        return float(self.model.step(**b))

    def clip(self, max_norm: float, norm_type: float) -> float:
        return float(self.model.clip_grad_norm_(max_norm, norm_type))

    def evaluate(self, b: dict[str, Any]) -> float:
        with _eval(self.model), torch.no_grad():
            return float(self.model.step(**b))


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    model.eval()
    try:
        yield
    finally:
        model.train()


def run(case: str, loop: Plain, *, replica: int = 0, dp: int = 1) -> dict[str, Any]:
    """The loop of ``case``; its losses, gradient norms, evaluation losses and final weights."""
    params = [p for p in loop.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    out: dict[str, Any] = {"loss": [], "norm": [], "eval": []}
    _steps(case, loop, opt, out, replica, dp)
    with _autocast(case):
        out["dtype"] = loop.output_dtype(batch(case, 0, replica=replica, dp=dp))
    out["frozen_grads"] = [
        n for n, p in loop.model.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    out["weights"] = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    return out


def _autocast(case: str) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast around each call (never around optimizer steps: autocast keeps its bf16
    copies of the weights until it exits)."""
    if case == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _steps(
    case: str, loop: Plain, opt: torch.optim.Optimizer, out: dict[str, Any], replica: int, dp: int
) -> None:
    for step in range(STEPS):
        parts = 1 if case == "small_batch" else 2  # accumulation over two calls
        for part in range(parts):
            with _autocast(case):
                loss = loop.step(batch(case, step, replica=replica, dp=dp, part=part))
            out["loss"].append(loss)
        out["norm"].append(loop.clip(1.0, float("inf") if step == 1 else 2.0))
        opt.step()
        opt.zero_grad()
        if case == "eval_between":
            out["eval"].append(loop.evaluate(batch(case, 100 + step, replica=replica, dp=dp)))


def one_process(case: str) -> dict[str, Any]:
    import pipepar

    model = build(case)
    pipe = pipepar.wrap(model, split=[split_path(case)], devices=["cpu", "cpu"], chunks=CHUNKS)
    return run(case, Piped(pipe))


def plain(case: str) -> dict[str, Any]:
    return run(case, Plain(build(case)))


def on_ranks(case: str, dp: int, schedule: str) -> dict[str, Any]:
    """This rank's run of ``case`` in a pp=2 x ``dp`` grid (under torchrun), and its place in
    the grid (``wrap`` starts the process group from torchrun's environment if none is)."""
    import pipepar.distributed as ppd

    model = build(case)
    pipe = ppd.wrap(model, split=[split_path(case)], chunks=CHUNKS, schedule=schedule, dp=dp)
    where = pipe.mesh.where
    try:
        out = run(case, Piped(pipe), replica=where.replica, dp=dp)
    finally:
        pipe.close()
    out["place"] = {"stage": where.stage, "replica": where.replica}
    return out


Runner = Callable[[str], dict[str, Any]]
