"""Pipe: a model split into stages that run micro-batches concurrently, on any schedule."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import commit_all, convert_deferred_batch_norm, reset_all
from pipepar.core.devices import DeviceSpec, resolve_devices
from pipepar.core.losses import Items, LossFn, joined_loss, loss_shares, split_target
from pipepar.core.microbatch import Value, check_value, gather, scatter, tensors
from pipepar.core.randomness import DrawLog
from pipepar.core.recompute import should_checkpoint
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage, iter_layers, split_stages
from pipepar.core.step import check_output
from pipepar.local import cpu_malloc
from pipepar.local.autograd import StepFunction, unalias
from pipepar.local.executor import BACKWARD, EVERY, FORWARD, Run
from pipepar.local.pipe_args import check_threads, count_workers, schedule_for, schedule_of_batch
from pipepar.local.placement import check_staying, cuda_device
from pipepar.local.transfer import move
from pipepar.local.worker import WorkerPool
from pipepar.tracing.tracer import Tracer

__all__ = ["Pipe"]


class Pipe(nn.Module):
    """A model whose layers are split into stages on several devices.

    Use :func:`pipepar.wrap` to build one. The pipe has the wrapped model's layers as its own
    children, under the same names, so ``parameters()``, ``state_dict()`` and
    ``load_state_dict()`` use exactly the keys of the plain model. Calling it splits the batch
    into ``chunks`` micro-batches, runs their forwards through the stages concurrently (one
    worker thread per device), and returns the joined output on the last stage's device;
    ``backward()`` runs the stages' backward actions concurrently too. :meth:`step` runs forward
    and backward together in the schedule's own order, so 1F1B and zero-bubble schedules keep
    their memory bound and fill their bubbles.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        *,
        devices: DeviceSpec = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        schedule: str | Schedule = "gpipe",
        threads: int | None = None,
        trace: bool = False,
    ) -> None:
        super().__init__()
        module = validation.check_model(module)
        self.chunks = validation.check_chunks(chunks)
        self.checkpoint = validation.check_checkpoint(checkpoint)
        balance = validation.check_balance(balance, len(module))
        validation.check_unique_layers(module)
        validation.check_shared_parameters(module, balance)
        workers = resolve_devices(devices, count_workers(schedule, balance, devices))
        # Built for one micro-batch to check the layout now; the real one per batch size.
        self._layout = schedule_for(schedule, len(balance), self.chunks, len(workers))
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module)  # type: ignore[assignment]
        for name, layer in module.named_children():
            self.add_module(name, layer)
        placed = [workers[w] for w in self._layout.placement]
        names = [name for name, _ in module.named_children()]
        self._stages = split_stages(list(module), balance, placed, names)
        self._workers_devices = workers
        self._draws = DrawLog()  # which stages draw random numbers, across mini-batches
        self.threads = check_threads(threads, workers, self.chunks)
        self.tracer: Tracer | None = Tracer() if trace else None
        self._pool: WorkerPool | None = None

    # -- the nn.Sequential look ---------------------------------------------------------------
    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [len(s.layers) for s in self._stages]

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device."""
        return [s.device for s in self._stages]

    @property
    def partitions(self) -> nn.ModuleList:
        """The stage modules that run (hooks on them fire); not children of the pipe, so the
        state_dict keys stay the plain model's."""
        return nn.ModuleList([_stage_module(s) for s in self._stages])

    def __len__(self) -> int:
        return sum(len(s.layers) for s in self._stages)

    def __iter__(self) -> Iterator[nn.Module]:
        yield from iter_layers(self._stages)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = list(self)
        return nn.Sequential(*layers[index]) if isinstance(index, slice) else layers[index]

    @property
    def schedule(self) -> Schedule:
        """The schedule of a full mini-batch (``chunks`` micro-batches)."""
        return self._schedule(self.chunks)

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"schedule={self._layout.name!r}"
        )

    # -- placement is the pipe's job --------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> Pipe:  # type: ignore[override]
        """``to(dtype)`` converts as usual; ``to(device)`` is a no-op where every stage is on
        that device already and a ValueError otherwise (the pipe places its stages)."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            check_staying("to(device)", self.devices, device)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipe:  # type: ignore[override]
        """A no-op where every stage is on that CUDA device already; a ValueError otherwise."""
        check_staying("cuda()", self.devices, cuda_device(device))
        return super().cuda(device)

    def cpu(self) -> Pipe:  # type: ignore[override]
        """A no-op where every stage is on the CPU already; a ValueError otherwise."""
        check_staying("cpu()", self.devices, torch.device("cpu"))
        return super().cpu()

    # -- running: forward now, backward when autograd reaches the pipe ------------------------
    def forward(self, input: Value) -> Value:
        """Run the batch through the pipeline; the output is on the last stage's device.

        The forwards run first and the backwards when ``backward()`` reaches the pipe (each in
        the schedule's order): the activations of every micro-batch are held in between, as
        under GPipe. Use :meth:`step` for a schedule's own memory bound.
        """
        try:
            return self._forward_batch(input)
        except BaseException:
            # The micro-batches that got through must not count towards the next mini-batch.
            reset_all(list(self))
            raise

    def _forward_batch(self, input: Value) -> Value:
        input = check_value(input, what="input")
        microbatches = scatter(input, self.chunks)
        if self._direct(len(microbatches)):
            return self._forward_direct(microbatches)
        params = [p for s in self._stages for p in s.trainable()]
        needs_grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors(input)) or bool(params)
        )
        run = self._run(microbatches, grad=needs_grad, input=input)
        if not needs_grad:
            return self._forward(run)
        self._tune_heap()
        return _PipeFunction.apply(self, run, len(tensors(input)), *tensors(input), *params)

    def _run(self, microbatches: list[Value], *, grad: bool, input: Value, head: Any = None) -> Run:
        return Run(
            self._stages,
            self._schedule(len(microbatches)),
            microbatches,
            checkpoint=self.checkpoint,
            grad=grad,
            input_requires_grad=any(t.requires_grad for t in tensors(input)),
            head=head,
            tracer=self.tracer,
            draws=self._draws,
        )

    def _schedule(self, m: int) -> Schedule:
        return schedule_of_batch(self._layout, m, self.chunks)

    def _direct(self, m: int) -> bool:
        """One stage and nothing to recompute: plain autograd does it all, with no overhead."""
        if len(self._stages) > 1 or self.tracer is not None:
            return False
        recompute = torch.is_grad_enabled() and self.training
        return not (recompute and any(should_checkpoint(self.checkpoint, i, m) for i in range(m)))

    def _forward_direct(self, microbatches: list[Value]) -> Value:
        stage = self._stages[0]
        outputs = [check_output(stage, x, stage.run(move(x, stage.device))) for x in microbatches]
        if self.training:
            commit_all(stage.layers)
        return gather(outputs)

    def _forward(self, run: Run) -> Value:
        run.execute(self._workers(backward=False), FORWARD)
        if run.training:
            commit_all(list(self))
        return gather(run.outputs())

    def _backward(self, run: Run, grads: Sequence[Tensor | None]) -> None:
        run.seed_gradients(grads)
        run.execute(self._workers(backward=True), BACKWARD)

    # -- running: the whole schedule in one call ------------------------------------------------
    def step(
        self, input: Value, target: Any, loss_fn: LossFn, *, items: Items | None = None
    ) -> Tensor:
        """Forward and backward of one mini-batch in the schedule's order; returns the loss.

        The last stage applies ``loss_fn(output, target)`` to each micro-batch as soon as its
        forward is done, so its backward can start at once: under ``"1f1b"`` stage ``j`` holds
        at most ``K - j`` micro-batches, and the zero-bubble schedules fill idle time with
        deferred weight gradients. Gradients accumulate into ``.grad`` exactly as with
        ``loss_fn(model(input), target).backward()``: the micro-batch losses are joined by
        what the loss averages over (rows; real targets for cross-entropy and NLL with
        ``ignore_index`` or class weights; nothing for ``reduction="sum"``; see
        :mod:`pipepar.core.losses`), and ``items`` says it for a custom loss. ``step`` runs the
        backward itself, so wrap the pipe in ``DistributedDataParallel`` only with
        ``pipe(x)`` + ``backward()``; for pipeline x data parallel use
        :mod:`pipepar.distributed` (``dp=``), which runs every schedule.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` it evaluates: only the
        forward actions of the schedule run, the same loss comes back, ``.grad`` is untouched
        and no activation is kept for a backward (call ``pipe.eval()`` first for dropout off).

        Args:
            input: the mini-batch (a tensor or a tuple of tensors, batch on dimension 0).
            target: what ``loss_fn`` compares with; split like the input (tensors with the
                batch on dimension 0) or passed whole to every micro-batch.
            loss_fn: ``loss_fn(output, target) -> scalar tensor``, e.g. ``F.cross_entropy``.
            items: for a custom ``loss_fn`` that averages over something other than rows,
                ``items(target_i)`` counts it in micro-batch ``i``'s target, e.g.
                ``lambda y: (y != pad).sum()``.

        Example:
            >>> loss = pipe.step(x, y, nn.functional.mse_loss)
            >>> opt.step(); opt.zero_grad()
            >>> with torch.no_grad():
            ...     val_loss = pipe.eval().step(x_val, y_val, nn.functional.mse_loss)
        """
        try:
            return self._step(input, target, loss_fn, items)
        except BaseException:
            reset_all(list(self))
            raise

    def _step(self, input: Value, target: Any, loss_fn: LossFn, items: Items | None) -> Tensor:
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable, but got {type(loss_fn).__name__}; pass e.g. "
                "torch.nn.functional.cross_entropy"
            )
        input = check_value(input, what="input")
        microbatches = scatter(input, self.chunks)
        rows = [tensors(x)[0].shape[0] for x in microbatches]
        targets = split_target(target, rows, self.devices[-1])
        shares = loss_shares(loss_fn, targets, rows, items)
        if not torch.is_grad_enabled():
            run = self._run(microbatches, grad=False, input=input, head=shares.head(targets))
            return self._evaluate(run, shares.weights)
        params = [p for s in self._stages for p in s.trainable()]
        run = self._run(microbatches, grad=True, input=input, head=shares.head(targets))
        self._tune_heap()
        weights = shares.weights
        loss = StepFunction.apply(
            self, run, weights, len(tensors(input)), *tensors(input), *params
        )
        loss.backward()
        return loss.detach()

    def _step_all(self, run: Run, weights: list[float]) -> Tensor:
        run.seed_losses(weights)
        run.execute(self._workers(backward=True), EVERY)
        if run.training:
            commit_all(list(self))
        return joined_loss(run.outputs(), weights)

    def _evaluate(self, run: Run, weights: list[float]) -> Tensor:
        """The schedule's forward actions only (``step`` under no_grad): the joined loss, with
        no graph kept (the steps run with ``grad=False``)."""
        run.execute(self._workers(backward=False), FORWARD)
        if run.training:
            commit_all(list(self))
        return joined_loss(run.outputs(), weights)

    # -- workers ------------------------------------------------------------------------------
    def _workers(self, *, backward: bool) -> WorkerPool | None:
        """The worker threads, or None to run on the caller's thread: with one worker, and for
        backward work on CUDA (the autograd engine's device threads would otherwise wait on
        each other; kernels are asynchronous, so devices still overlap)."""
        cuda = backward and any(d.type == "cuda" for d in self.devices)
        if len(self._workers_devices) == 1 or cuda:
            return None
        if self._pool is None:
            self._pool = WorkerPool(self._workers_devices, threads=self.threads)
        return self._pool

    def _tune_heap(self) -> None:
        if any(d.type == "cpu" for d in self.devices):
            cpu_malloc.tune()  # gradient buffers of every micro-batch: see pipepar.local.cpu_malloc

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients by the whole model's norm, exactly as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the plain model does
        (each tied weight counted once); returns the total norm.

        Example:
            >>> pipe.step(x, y, loss_fn)
            >>> norm = pipe.clip_grad_norm_(1.0)
            >>> opt.step(); opt.zero_grad()
        """
        return torch.nn.utils.clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, error_if_nonfinite
        )

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the pipe is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        return state


def _stage_module(stage: Stage) -> nn.Module:
    return stage.module


class _PipeFunction(torch.autograd.Function):
    """The autograd node standing for the whole pipeline (inputs: batch tensors, parameters)."""

    @staticmethod
    def forward(ctx: Any, pipe: Pipe, run: Run, n_inputs: int, *args: Tensor) -> Any:
        out = pipe._forward(run)
        ctx.pipe, ctx.run, ctx.n_inputs = pipe, run, n_inputs
        outs = tuple(unalias(t, args) for t in tensors(out))
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs[0] if isinstance(out, Tensor) else outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        pipe, run = ctx.pipe, ctx.run
        ctx.run = None  # free the records even if backward fails
        if run is None:
            raise RuntimeError("pipepar: backward through a pipe output twice is not supported")
        pipe._backward(run, grads)
        return (None, None, None, *run.input_grads(), *run.take_param_grads())
