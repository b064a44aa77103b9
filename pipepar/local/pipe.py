"""Pipe: an ``nn.Sequential`` split into stages that run micro-batches concurrently (GPipe)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import commit_all, convert_deferred_batch_norm, reset_all
from pipepar.core.devices import DeviceSpec, resolve_devices
from pipepar.core.microbatch import Value, check_value, gather, scatter, tensors
from pipepar.core.recompute import should_checkpoint
from pipepar.core.stage import iter_layers, split_stages
from pipepar.local import cpu_malloc
from pipepar.local.engine import Run, backward_order, forward_order, wavefront
from pipepar.local.transfer import move
from pipepar.local.worker import WorkerPool, run_inline
from pipepar.tracing.tracer import Tracer

__all__ = ["Pipe", "wrap"]


class Pipe(nn.Module):
    """An ``nn.Sequential`` whose layers are split into stages on several devices.

    Use :func:`wrap` to build one. The pipe has the wrapped model's layers as its own children,
    under the same names, so ``parameters()``, ``state_dict()`` and ``load_state_dict()`` use
    exactly the keys of the plain model. Calling it splits the batch into ``chunks``
    micro-batches, runs them through the stages concurrently (one worker thread per stage), and
    returns the joined output on the last stage's device; ``backward()`` runs the stages'
    backward passes concurrently too.
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
        resolved = resolve_devices(devices, len(balance))
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module)  # type: ignore[assignment]
        for name, layer in module.named_children():
            self.add_module(name, layer)
        self._stages = split_stages(list(module), balance, resolved)
        self.threads = _check_threads(threads, resolved, self.chunks)
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
    def partitions(self) -> list[nn.Sequential]:
        """Each stage's layers as an ``nn.Sequential`` (the same module objects)."""
        return [nn.Sequential(*s.layers) for s in self._stages]

    def __len__(self) -> int:
        return sum(len(s.layers) for s in self._stages)

    def __iter__(self) -> Iterator[nn.Module]:
        yield from iter_layers(self._stages)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = list(self)
        return nn.Sequential(*layers[index]) if isinstance(index, slice) else layers[index]

    def extra_repr(self) -> str:
        return f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}"

    # -- placement is the pipe's job --------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> Pipe:  # type: ignore[override]
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            raise _moving_denied("to(device)")
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipe:  # type: ignore[override]
        raise _moving_denied("cuda()")

    def cpu(self) -> Pipe:  # type: ignore[override]
        raise _moving_denied("cpu()")

    # -- running ------------------------------------------------------------------------------
    def forward(self, input: Value) -> Value:
        """Run the batch through the pipeline; the output is on the last stage's device."""
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
        run = Run(
            self._stages,
            microbatches,
            checkpoint=self.checkpoint,
            grad=needs_grad,
            input_requires_grad=any(t.requires_grad for t in tensors(input)),
            blocking=self._concurrent(),
            tracer=self.tracer,
        )
        if not needs_grad:
            return self._forward(run)
        if any(d.type == "cpu" for d in self.devices):
            cpu_malloc.tune()  # gradient buffers of every micro-batch: see pipepar.cpu_malloc
        n_inputs = len(tensors(input))
        out = _PipeFunction.apply(self, run, n_inputs, *tensors(input), *params)
        return out

    def _direct(self, m: int) -> bool:
        """One stage and nothing to recompute: plain autograd does it all, with no overhead."""
        if len(self._stages) > 1 or self.tracer is not None:
            return False
        recompute = torch.is_grad_enabled() and self.training
        return not (recompute and any(should_checkpoint(self.checkpoint, i, m) for i in range(m)))

    def _forward_direct(self, microbatches: list[Value]) -> Value:
        stage = self._stages[0]
        outputs = [stage.run(move(x, stage.device)) for x in microbatches]
        if self.training:
            commit_all(stage.layers)
        return gather(outputs)

    def _forward(self, run: Run) -> Value:
        k, m = len(self._stages), run.m
        self._execute(run, forward_order(k, m), run.forward, forward=True)
        if run.training:
            commit_all(list(self))
        return gather(run.outputs())

    def _backward(self, run: Run, grads: Sequence[Tensor | None]) -> None:
        run.seed_gradients(grads)
        k, m = len(self._stages), run.m
        self._execute(run, backward_order(k, m), run.backward, forward=False)

    def _concurrent(self) -> bool:
        return len(self._stages) > 1

    def _execute(
        self, run: Run, per_stage: list[list[tuple[int, int]]], action: Any, *, forward: bool
    ) -> None:
        # CUDA backward runs on the caller's thread: the autograd engine's device threads would
        # otherwise wait on each other. Kernels are asynchronous, so devices still overlap.
        cuda_backward = not forward and any(d.type == "cuda" for d in self.devices)
        if not self._concurrent() or cuda_backward:
            run.acts._blocking = run.grads._blocking = False
            run_inline([_bind(action, j, i, run) for j, i in wavefront(per_stage, forward)])
            return
        jobs = [_stage_job(action, actions, run) for actions in per_stage]
        self._workers().run(jobs, run.grads if not forward else run.acts)

    def _workers(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool(self.devices, threads=self.threads)
        return self._pool

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the pipe is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        return state


def _bind(action: Any, j: int, i: int, run: Run) -> Any:
    def call() -> None:
        _annotated(action, j, i, run)

    return call


def _stage_job(action: Any, actions: list[tuple[int, int]], run: Run) -> Any:
    def job() -> None:
        for j, i in actions:
            (run.acts if action == run.forward else run.grads).check()
            _annotated(action, j, i, run)

    return job


def _annotated(action: Any, j: int, i: int, run: Run) -> None:
    try:
        action(j, i)
    except Exception as error:
        if not getattr(error, "_pipepar_noted", False) and type(error).__name__ != "Aborted":
            phase = "forward" if action == run.forward else "backward"
            error.add_note(
                f"pipepar: raised in {run.stages[j].describe()}, micro-batch {i}, {phase}"
            )
            error._pipepar_noted = True  # type: ignore[attr-defined]
        raise


class _PipeFunction(torch.autograd.Function):
    """The autograd node standing for the whole pipeline (inputs: batch tensors, parameters)."""

    @staticmethod
    def forward(ctx: Any, pipe: Pipe, run: Run, n_inputs: int, *args: Tensor) -> Any:
        out = pipe._forward(run)
        ctx.pipe, ctx.run, ctx.n_inputs = pipe, run, n_inputs
        outs = tuple(_unalias(t, args) for t in tensors(out))
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs[0] if isinstance(out, Tensor) else outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        pipe, run = ctx.pipe, ctx.run
        ctx.run = None  # free the records even if backward fails
        if run is None:
            raise RuntimeError("pipepar: backward through a pipe output twice is not supported")
        pipe._backward(run, grads)
        return (None, None, None, *run.input_grads(), *run.all_param_grads())


def _unalias(t: Tensor, inputs: Sequence[Tensor]) -> Tensor:
    """Autograd forbids a custom function returning one of its inputs as an output."""
    return t.clone() if any(t is x or t.data_ptr() == x.data_ptr() for x in inputs) else t


def _moving_denied(call: str) -> ValueError:
    return ValueError(
        f"Pipe.{call} would move every stage to one device; a Pipe places its stages itself. "
        "Move the model before wrapping, or pass devices=[...] to pipepar.wrap"
    )


def _check_threads(threads: int | None, devices: list[torch.device], chunks: int) -> list[int]:
    """Math threads per stage: ``threads``, or the cores shared among the CPU stages that
    compute at once on average, ``K * M / (M + K - 1)`` under GPipe, rounded (K CPU stages, M
    micro-batches): with ``chunks=1`` the stages take turns and each gets every core."""
    if threads is not None and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise ValueError(
            f"threads must be a positive int or None, but got {threads!r}; e.g. threads=1"
        )
    k = sum(d.type == "cpu" for d in devices)
    at_once = max(1, round(k * chunks / (chunks + k - 1))) if k else 1
    share = threads or max(1, torch.get_num_threads() // at_once)
    return [share if d.type == "cpu" else 1 for d in devices]


def wrap(
    module: nn.Sequential,
    balance: Sequence[int] | None = None,
    *,
    devices: DeviceSpec = None,
    chunks: int = 1,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    sample: Value | None = None,
    capacity: Any = None,
    threads: int | None = None,
    trace: bool = False,
) -> Pipe:
    """Split ``module`` into pipeline stages (GPipe) and return the :class:`Pipe`.

    Takes the same arguments as ``torchgpipe.GPipe``. With ``balance=None`` the model is
    profiled on ``sample`` and split by :func:`pipepar.plan` to fit ``capacity``.

    Args:
        module: the ``nn.Sequential`` to split; its layers are moved to their stage's device.
        balance: layers per stage, e.g. ``[3, 3, 2]``; ``None`` to plan it from ``sample``.
        devices: one device per stage; ``None`` = all CUDA devices, or the CPU for every stage.
        chunks: micro-batches per mini-batch (M).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` recompute in backward.
        deferred_batch_norm: track batch-norm statistics over the whole mini-batch.
        sample: an input batch to profile when ``balance`` is None.
        capacity: bytes per device for planning (int, ``"16GiB"``, or one per device).
        threads: math threads per CPU stage; default: ``torch.get_num_threads()`` shared among
            the CPU stages that compute at once on average (``round(K*M/(M+K-1))``).
        trace: record a timeline of every action in ``pipe.tracer``.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
        >>> pipe = pipepar.wrap(model, [4, 4], devices=["cpu", "cpu"], chunks=4)
        >>> pipe(torch.randn(32, 16)).sum().backward()
    """
    if balance is None:
        balance = _planned_balance(module, sample, devices, capacity, chunks, checkpoint)
    return Pipe(
        module,
        balance,
        devices=devices,
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        threads=threads,
        trace=trace,
    )


def _planned_balance(
    module: nn.Sequential,
    sample: Value | None,
    devices: DeviceSpec,
    capacity: Any,
    chunks: int,
    checkpoint: str,
) -> list[int]:
    from pipepar.planner.plan import plan
    from pipepar.planner.profile import profile

    module = validation.check_model(module)
    if sample is None:
        raise ValueError(
            "balance is None and no sample was given; pass balance=[...] (layers per stage) or "
            "sample=<an input batch> so pipepar can profile the model and plan the split"
        )
    param = next(module.parameters(), None)
    where = param.device if param is not None else torch.device("cpu")
    n_devices = devices if devices is not None else (torch.cuda.device_count() or 1)
    prof = profile(module, sample, device=str(where))
    return list(
        plan(
            prof,
            devices=n_devices,
            capacity=capacity,
            chunks=chunks,
            checkpoint=checkpoint,
            optimizer=None,
        ).balance
    )
