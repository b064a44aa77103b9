"""How a pipe runs an ``nn.Sequential``: a chain of layers, each stage's output handed to the
next (:class:`ChainCompute`).

The model's units are its layers. Each micro-batch's value goes from stage to stage through the
executor's hand-off points (:mod:`pipepar.local.executor`), so nothing of the model's code runs
but its layers; one stage with nothing to recompute runs on plain autograd, with no overhead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import committing, defer_statistics
from pipepar.core.first_calls import FirstCalls
from pipepar.core.given import Given
from pipepar.core.losses import Items, LossFn, joined_loss, loss_shares, split_target
from pipepar.core.microbatch import Value, check_value, gather, scatter, tensors
from pipepar.core.recompute import should_checkpoint
from pipepar.core.stage import Stage, iter_layers, split_stages
from pipepar.core.step import check_output
from pipepar.local import cpu_malloc
from pipepar.local.autograd import BACKWARD_TWICE, StepFunction, unalias
from pipepar.local.executor import BACKWARD, EVERY, FORWARD, Run
from pipepar.local.pipe_view import PipeView
from pipepar.local.transfer import move

__all__ = [
    "ChainCall",
    "ChainCompute",
    "chain_step_arguments",
    "is_chain",
    "one_input",
    "runs_directly",
]


def is_chain(module: object, split: object = None, sample: object = None) -> bool:
    """Whether a pipe (of one process or across ranks) runs ``module`` as a chain of layers: an
    ``nn.Sequential`` split by ``balance`` (not by module paths, and not sampled with keyword
    arguments)."""
    return isinstance(module, nn.Sequential) and split is None and not isinstance(sample, dict)


@dataclass(frozen=True)
class ChainCall:
    """What ``pipe.step(input, target, loss_fn, items=...)`` of an ``nn.Sequential`` was given
    (across ranks, ``input`` is None on all but the first stage's ranks)."""

    input: Value | None
    target: Any
    loss_fn: LossFn
    items: Items | None = None
    scale: float = 1.0
    """A loss scaler's scale: each micro-batch's backward seed is multiplied by it."""
    given: Given | None = None
    """The micro-batches (and targets) the caller made, in place of ``input`` (and
    ``target``)."""

    def microbatches(
        self, chunks: int, device: torch.device | None
    ) -> tuple[list[Value], list[Any]]:
        """The micro-batch inputs (``input`` split into at most ``chunks``, or the caller's)
        and their targets (tensors on ``device``, the last stage's)."""
        if self.given is not None:
            given = self.given.microbatches
            inputs = [check_value(x, what=f"microbatches[{i}]") for i, x in enumerate(given)]
            return inputs, self.given.targets_on(device)
        inputs = scatter(check_value(self.input, what="input"), chunks)
        rows = [tensors(x)[0].shape[0] for x in inputs]
        return inputs, split_target(self.target, rows, device)


class ChainCompute:
    """An ``nn.Sequential`` split by ``balance`` (layers per stage), checked before anything
    is placed: every layer once, and a weight shared by two layers within one stage."""

    default_checkpoint = "except_last"  # as torchgpipe

    def __init__(
        self,
        module: nn.Module,
        balance: Sequence[int] | None,
        *,
        deferred_batch_norm: bool,
        batch_coupling: str = "error",
    ) -> None:
        chain = validation.check_model(module)
        self.sizes = validation.check_balance(balance, len(chain))
        validation.check_unique_layers(chain)
        validation.check_shared_parameters(chain, self.sizes)
        defer_statistics(chain, deferred_batch_norm)
        self.model: nn.Sequential = chain
        self.paths = [name for name, _ in chain.named_children()]
        """Each unit's (layer's) name in the model."""
        self._watch = FirstCalls(chain, batch_coupling, deferred_batch_norm)

    def place(self, devices: Sequence[torch.device], checkpoint: str) -> list[Stage]:
        """The stages on their ``devices`` (layers moved there), each watched on a new kind
        of input for code mixing the rows of the batch."""
        stages = split_stages(list(self.model), self.sizes, list(devices), self.paths)
        for stage in stages:
            stage.watch = self._watch
        return stages

    # -- pipe(x) --------------------------------------------------------------------------------
    def forward(self, pipe: PipeView, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
        """Run the batch through the stages (forwards now, backwards when autograd reaches the
        pipe): the output on the last stage's device."""
        input = one_input(args, kwargs)
        # Deferred batch norms commit the mini-batch's statistics once its forwards ran; if
        # they fail, the micro-batches that got through do not count towards the next.
        with committing(list(iter_layers(pipe.stages))):
            return self._forward_batch(pipe, input)

    def _forward_batch(self, pipe: PipeView, input: Value) -> Value:
        input = check_value(input, what="input")
        microbatches = scatter(input, pipe.chunks)
        if runs_directly(pipe, len(microbatches)):
            return _forward_direct(pipe, microbatches)
        params = [p for s in pipe.stages for p in s.trainable()]
        needs_grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors(input)) or bool(params)
        )
        run = _run(pipe, microbatches, grad=needs_grad)
        if not needs_grad:
            return forward_all(pipe, run)
        _tune_heap(pipe)
        xs = tensors(input)
        return _PipeFunction.apply(pipe, run, len(xs), *xs, *params)

    # -- pipe.step ------------------------------------------------------------------------------
    def step(self, pipe: PipeView, call: ChainCall) -> Tensor:
        """Forward and backward of one mini-batch in the schedule's order; the joined loss
        (see :meth:`pipepar.pipe.Pipe.step`)."""
        with committing(list(iter_layers(pipe.stages))):
            return _step(pipe, call)

    def close(self) -> None:
        """Nothing of its own to stop (the pipe's workers are the pipe's)."""


def one_input(args: tuple[Any, ...], kwargs: dict[str, Any], name: str = "input") -> Value:
    """The one input of an ``nn.Sequential``'s call (``pipe(x)`` or ``pipe(input=x)``; the
    keyword is ``name``)."""
    if len(args) + len(kwargs) != 1 or (kwargs and name not in kwargs):
        raise TypeError(
            "a pipe of an nn.Sequential takes one input (the batch, as nn.Sequential does), but "
            f"got {len(args)} positional and keyword arguments {sorted(kwargs)}; pass "
            "pipe(x) with x a tensor or a tuple of tensors"
        )
    return args[0] if args else kwargs[name]


def chain_step_arguments(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_fn: LossFn | None,
    items: Items | None,
    name: str = "input",
    given: Given | None = None,
) -> ChainCall:
    """What ``pipe.step(input, target, loss_fn, items=...)`` of an ``nn.Sequential`` was given,
    positionally or by name (the input's keyword is ``name``), or with ``given`` micro-batches
    ``step(microbatches=..., targets=..., loss_fn=...)``."""
    if given is not None:
        if loss_fn is None:
            raise TypeError(
                "step() is missing 'loss_fn'; call pipe.step(microbatches=[...], "
                "targets=[...], loss_fn=fn), e.g. loss_fn=torch.nn.functional.mse_loss"
            )
        return ChainCall(None, None, loss_fn, items, given=given)
    if len(args) > 3 or set(kwargs) - {name}:
        raise TypeError(
            f"step() of a pipe of an nn.Sequential takes ({name}, target, loss_fn, *, items), "
            f"but got {len(args)} positional arguments and keywords {sorted(kwargs)}; call "
            "pipe.step(x, y, loss_fn)"
        )
    named = dict(zip((name, "target", "loss_fn"), args))
    named_too = [(k, v) for k, v in (("target", target), ("loss_fn", loss_fn)) if v is not None]
    for key, value in list(kwargs.items()) + named_too:
        if key in named:
            raise TypeError(f"step() got multiple values for argument {key!r}")
        named[key] = value
    for key in (name, "loss_fn"):
        if key not in named:
            raise TypeError(
                f"step() is missing {key!r}; call pipe.step(x, y, loss_fn), e.g. "
                "pipe.step(x, y, torch.nn.functional.cross_entropy)"
            )
    return ChainCall(named[name], named.get("target"), named["loss_fn"], items)


# -- running ------------------------------------------------------------------------------------
def _run(pipe: PipeView, microbatches: list[Value], *, grad: bool, head: Any = None) -> Run:
    return Run(
        pipe.stages,
        pipe.schedule(len(microbatches)),
        microbatches,
        checkpoint=pipe.checkpoint,
        offload=pipe.offload,
        grad=grad,
        input_requires_grad=any(t.requires_grad for x in microbatches for t in tensors(x)),
        head=head,
        tracer=pipe.tracer,
        draws=pipe.draws,
        timing=pipe.timing(),
    )


def runs_directly(pipe: PipeView, m: int) -> bool:
    """Whether a batch of ``m`` micro-batches runs on plain autograd, on the caller's thread,
    with no overhead: one stage, no timeline, and nothing to recompute."""
    if len(pipe.stages) > 1 or pipe.tracer is not None:
        return False
    recompute = torch.is_grad_enabled() and pipe.training
    return not (recompute and any(should_checkpoint(pipe.checkpoint, i, m) for i in range(m)))


def _forward_direct(pipe: PipeView, microbatches: list[Value]) -> Value:
    stage, m = pipe.stages[0], len(microbatches)
    outputs = []
    for i, x in enumerate(microbatches):
        x = move(x, stage.device)
        watch = stage.watch.watching(0, x, m) if i == 0 and stage.watch is not None else None
        with watch or contextlib.nullcontext():
            outputs.append(check_output(stage, x, stage.run(x)))
    return gather(outputs)


def forward_all(pipe: PipeView, run: Run) -> Value:
    """Every micro-batch's forward through the stages: the joined output."""
    pipe.execute(run, FORWARD)
    return gather(run.outputs())


def _step(pipe: PipeView, call: ChainCall) -> Tensor:
    if not callable(call.loss_fn):
        raise TypeError(
            f"loss_fn must be callable, but got {type(call.loss_fn).__name__}; pass e.g. "
            "torch.nn.functional.cross_entropy"
        )
    microbatches, targets = call.microbatches(pipe.chunks, pipe.devices[-1])
    rows = [tensors(x)[0].shape[0] for x in microbatches]
    shares = loss_shares(call.loss_fn, targets, rows, call.items).scaled(call.scale)
    grad = torch.is_grad_enabled()
    loss_of = shares.head_of(call.loss_fn, targets)
    seeded: list[Run] = []

    def head(output: Any, i: int) -> Tensor:
        loss = loss_of(output, i)  # micro-batch 0's shows every micro-batch's share
        if seeded:
            seeded[0].seed_loss(i, shares.seeds[i])
        return loss

    run = _run(pipe, microbatches, grad=grad, head=head)
    if not grad:  # evaluation: the schedule's forward actions only, no graph kept
        pipe.execute(run, FORWARD)
        return joined_loss(run.outputs(), shares.weights)
    params = [p for s in pipe.stages for p in s.trainable()]
    _tune_heap(pipe)
    xs = [t for x in microbatches for t in tensors(x)]  # their gradients: micro-batch by one
    seeded.append(run)
    loss = StepFunction.apply(lambda: _step_all(pipe, run, shares.weights), run, *xs, *params)
    loss.backward()
    return loss.detach()


def _step_all(pipe: PipeView, run: Run, weights: Sequence[float]) -> Tensor:
    pipe.execute(run, EVERY)
    return joined_loss(run.outputs(), weights)


def _tune_heap(pipe: PipeView) -> None:
    if any(d.type == "cpu" for d in pipe.devices):
        cpu_malloc.tune()  # gradient buffers of every micro-batch: see pipepar.local.cpu_malloc


class _PipeFunction(torch.autograd.Function):
    """The autograd node standing for the whole pipeline (inputs: batch tensors, parameters)."""

    @staticmethod
    def forward(ctx: Any, pipe: PipeView, run: Run, n_inputs: int, *args: Tensor) -> Any:
        out = forward_all(pipe, run)
        ctx.pipe, ctx.run, ctx.n_inputs = pipe, run, n_inputs
        outs = tuple(unalias(t, args) for t in tensors(out))
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs[0] if isinstance(out, Tensor) else outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        pipe, run = ctx.pipe, ctx.run
        ctx.run = None  # free the records even if backward fails
        if run is None:
            raise RuntimeError(BACKWARD_TWICE)
        run.seed_gradients(grads)
        pipe.execute(run, BACKWARD, backward=True)
        return (None, None, None, *run.input_grads(), *run.take_param_grads())
