"""ModelPipe: any ``nn.Module`` split into stages as it is, and called like the model.

The model keeps its own code, submodules and names: its units (:mod:`pipepar.program.units`)
are placed on their stage's device, and each micro-batch's forward runs the model's own
``forward``, cut into stages while it runs (:mod:`pipepar.program.cut`), in the schedule's
order (:mod:`pipepar.program.driver`). Values crossing a boundary travel by themselves;
a weight used by two stages (tied embedding and head) is held by the first and its gradients
from both are summed there.

To whatever inspects a model (HF ``Trainer``, ``accelerate``) the pipe looks like it: its class
is made for the model's class and its ``forward`` has the model's signature, an attribute it
lacks is the model's (``__getattr__``), ``hf_device_map`` says where its units sit, and
``to(device)`` is a no-op where every stage is there already (:mod:`pipepar.program.hf`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.batchnorm import committing, convert_inside, reset_all
from pipepar.core.devices import DeviceSpec, resolve_devices
from pipepar.core.losses import Items, LossShares, joined_loss, split_target
from pipepar.core.randomness import DrawLog
from pipepar.core.schedule import Schedule
from pipepar.core.stage import Stage
from pipepar.local import cpu_malloc
from pipepar.local.autograd import StepFunction as _StepFunction
from pipepar.local.executor import EVERY, FORWARD
from pipepar.local.pipe import Pipe
from pipepar.local.pipe_args import check_threads as _check_threads
from pipepar.local.pipe_args import count_workers as _n_workers
from pipepar.local.pipe_args import schedule_for as _schedule_for
from pipepar.local.pipe_args import schedule_of_batch
from pipepar.local.placement import check_staying as _check_staying
from pipepar.local.placement import cuda_device as _cuda_device
from pipepar.local.worker import WorkerPool
from pipepar.program import generation, hf
from pipepar.program import units as units_
from pipepar.program.autograd import ProgramFunction, as_tuple, joined
from pipepar.program.calls import Call, split_call
from pipepar.program.cut import Cut, Ledger
from pipepar.program.driver import driver_pool, watch_units
from pipepar.program.losses import LossFn, ModelLoss, callers, loss_head, step_shares
from pipepar.program.recompute import checkpoint_units
from pipepar.program.rerun import Rerun
from pipepar.program.route import PathChanged, Routes, signature
from pipepar.program.run import ProgramRun
from pipepar.program.step import Batch
from pipepar.program.units import sizes_of as _sizes
from pipepar.tracing.tracer import Tracer

__all__ = ["ModelPipe"]

T = TypeVar("T")


class ProgramStage(Stage):
    """A stage of a model cut while it runs: its units, named by their module paths."""

    def describe(self) -> str:
        names = self.paths
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        return f"stage {self.index} ({span} on {self.device})"

    @property
    def paths(self) -> list[str]:
        return [n.replace("/", ".") for n in self.names or []]


class ModelPipe(nn.Module):
    """Any model split into pipeline stages, called with the model's own arguments.

    Build one with :func:`pipepar.wrap`. The pipe's children are the model's, so
    ``named_parameters()`` and ``state_dict()`` use the model's own names (a checkpoint of the
    plain model loads into the pipe and back), and a tied weight is listed once.

    Args:
        model: the module to split (any ``nn.Module``).
        balance: units per stage (:func:`pipepar.units` lists the units); or
        split: module paths where a new stage begins, e.g. ``["transformer.h.6"]``.
        devices: one device per stage (per device for the virtual-stage schedules).
        chunks: micro-batches per mini-batch.
        sample: an example call (a tensor, a tuple of positional arguments, or a dict of
            keyword arguments): units are then ordered as the model calls them.
        schedule: a schedule name or object (:mod:`pipepar.core.schedule`).
        checkpoint: ``"never"``, ``"always"`` or ``"except_last"``: stages recompute their
            units in backward for those micro-batches (:mod:`pipepar.program.recompute`).
        deferred_batch_norm: batch-norm layers track their running statistics over the whole
            mini-batch, once per call (:mod:`pipepar.core.batchnorm`), not per micro-batch.
        threads: math threads per CPU stage.
        trace: record a timeline in ``pipe.tracer``.
    """

    _model: nn.Module  # not a child: its children are the pipe's
    _model_class: type[nn.Module] | None = None  # set on the class made for a model class
    hf_device_map: dict[str, int | str]
    is_parallelizable: bool
    model_parallel: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> ModelPipe:
        """A pipe of a model is an instance of the ModelPipe subclass made for the model's
        class, named as it, whose ``forward`` shows the model's signature
        (:func:`pipepar.program.hf.class_for`)."""
        model = args[0] if args else kwargs.get("model")
        if cls is ModelPipe and isinstance(model, nn.Module):
            return super().__new__(hf.class_for(ModelPipe, type(model)))
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        *,
        split: Sequence[str] | None = None,
        devices: DeviceSpec = None,
        chunks: int = 1,
        sample: Any = None,
        schedule: str | Schedule = "gpipe",
        checkpoint: str = "never",
        deferred_batch_norm: bool = False,
        threads: int | None = None,
        trace: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"module must be an nn.Module, but got {type(model).__name__}; "
                "pass the model to split"
            )
        self.chunks = validation.check_chunks(chunks)
        self.checkpoint = validation.check_checkpoint(checkpoint)
        if deferred_batch_norm:
            convert_inside(model)
        order = _call_order(model, sample) if sample is not None else None
        lay = units_.layout(model, order)
        sizes = _sizes(lay, balance, split)
        stage_of_unit = [s for s, n in enumerate(sizes) for _ in range(n)]
        workers = resolve_devices(devices, _n_workers(schedule, sizes, devices))
        self._layout = _schedule_for(schedule, len(sizes), self.chunks, len(workers))
        placed = [workers[w] for w in self._layout.placement]
        self._owner = units_.owners(lay, stage_of_unit)
        _place(model, lay, stage_of_unit, self._owner, placed)
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        # Set after the children: until then no name falls back to the model (__getattr__).
        object.__setattr__(self, "_model", model)
        self._stages = _stages(lay, stage_of_unit, placed)
        self._params = _held(model, self._owner, len(sizes))
        self._units = lay
        self._hooks = watch_units(lay.units, stage_of_unit)
        if self.checkpoint != "never":
            checkpoint_units([u.module for u in lay.units if u.has_parameters])
        self._devices_of_workers = workers
        self._draws = DrawLog()  # which stages draw random numbers, across mini-batches
        self._routes = Routes()  # where values cross, by kind of call
        self._rerun = Rerun(model, placed)  # what a call run again starts from
        self.threads = _check_threads(threads, workers, self.chunks)
        self.tracer: Tracer | None = Tracer() if trace else None
        self._pool: WorkerPool | None = None
        self._drivers: ThreadPoolExecutor | None = None
        # Placed already, across devices or not: Trainer and accelerate leave it where it is.
        self.hf_device_map = hf.device_map(
            [u.path for u in lay.units], [placed[s] for s in stage_of_unit]
        )
        self.is_parallelizable = self.model_parallel = hf.spans_devices(placed)

    # -- what the pipe is ---------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (its forward is what runs)."""
        return self._model

    @property
    def balance(self) -> list[int]:
        """Units per stage."""
        return [len(s.layers) for s in self._stages]

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device."""
        return [s.device for s in self._stages]

    @property
    def stage_paths(self) -> list[list[str]]:
        """The module paths of each stage's units."""
        return [s.paths for s in self._stages]  # type: ignore[attr-defined]

    @property
    def schedule(self) -> Schedule:
        return self._schedule(self.chunks)

    def extra_repr(self) -> str:
        starts = [paths[0] for paths in self.stage_paths]
        return (
            f"stages start at {starts}, chunks={self.chunks}, "
            f"schedule={self._layout.name!r}, checkpoint={self.checkpoint!r}"
        )

    def train(self, mode: bool = True) -> ModelPipe:
        super().train(mode)
        self._model.train(mode)  # the model's own flag, read by its forward
        return self

    def to(self, *args: Any, **kwargs: Any) -> ModelPipe:  # type: ignore[override]
        """``to(dtype)`` converts as usual; ``to(device)`` is a no-op where every stage is on
        that device already (as HF Trainer and accelerate call it) and a ValueError otherwise:
        the pipe places its stages."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            _check_staying("to(device)", self.devices, device)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> ModelPipe:  # type: ignore[override]
        """A no-op where every stage is on that CUDA device already; a ValueError otherwise."""
        _check_staying("cuda()", self.devices, _cuda_device(device))
        return super().cuda(device)

    def cpu(self) -> ModelPipe:  # type: ignore[override]
        """A no-op where every stage is on the CPU already; a ValueError otherwise."""
        _check_staying("cpu()", self.devices, torch.device("cpu"))
        return super().cpu()

    # -- looking like the model (for HF Trainer, accelerate, and anything that inspects it) ---
    def __getattr__(self, name: str) -> Any:
        """An attribute the pipe lacks is the wrapped model's.

        The rule: the pipe's own attributes come first (its methods and properties, and
        ``hf_device_map``, ``is_parallelizable``, ``model_parallel`` set for its placement),
        then, as for any module, its parameters, buffers and children (the model's); any other
        name but a dunder is looked up on the model. So ``pipe.config``,
        ``pipe.main_input_name``, ``pipe.loss_type`` or ``pipe.get_input_embeddings()`` answer
        what the model answers. A method found this way runs on the model itself, unsplit.
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")  # absent while building or unpickling
            if model is None or (name.startswith("__") and name.endswith("__")):
                raise
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__qualname__} has no attribute {name!r}, and neither has the "
                f"wrapped {type(model).__name__}"
            ) from None

    # -- running ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on the batch, micro-batch by micro-batch through the stages, and
        return what the model returns (joined over the micro-batches)."""
        calls = split_call(args, kwargs, self.chunks)
        shares = ModelLoss(self._model, calls) if "labels" in kwargs else None
        return self._retrying(lambda: self._forward(calls, shares))

    def _forward(self, calls: list[Call], shares: ModelLoss | None) -> Any:
        params = [p for held in self._params for p in held]
        flat_in = [t for c in calls for t in c.tensors()]
        needs_grad = torch.is_grad_enabled() and (
            bool(params) or any(t.requires_grad for t in flat_in)
        )
        run = self._run(calls, grad=needs_grad, shares=shares)
        if not needs_grad:
            run.execute(self._workers(), FORWARD)
            return joined(run.results(), run.rows, shares)
        holder: dict[str, Any] = {}
        outs = ProgramFunction.apply(self, run, holder, shares, len(flat_in), *flat_in, *params)
        leaves = list(holder["leaves"])
        for k, t in zip(holder["positions"], as_tuple(outs)):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, holder["spec"])

    def step(
        self,
        *args: Any,
        loss_fn: LossFn | None = None,
        target: Any = None,
        items: Items | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Forward and backward of one mini-batch in the schedule's order; returns the loss.

        The loss is what ``loss_fn(output, target)`` returns for each micro-batch or, without
        ``loss_fn``, the model's own (``output.loss``, or the first element of a tuple, as
        transformers models return when given ``labels=``). The micro-batch losses are joined
        into exactly the loss of the whole batch, whatever it averages over: rows, real
        tokens (``-100`` labels, ``ignore_index``, class weights) or a count passed as
        ``num_items_in_batch`` (see :mod:`pipepar.core.losses` and
        :mod:`pipepar.program.losses`); ``items(target_i)`` tells what a custom ``loss_fn``
        averages over. Gradients accumulate into ``.grad``.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` it evaluates: only the
        forward actions of the schedule run, the same loss comes back, ``.grad`` is untouched
        and no activation is kept for a backward (call ``pipe.eval()`` first for dropout off).

        Example:
            >>> loss = pipe.step(input_ids=ids, labels=ids)
            >>> opt.step(); opt.zero_grad()
            >>> with torch.no_grad():
            ...     val_loss = pipe.eval().step(input_ids=val_ids, labels=val_ids)
        """
        calls = split_call(args, kwargs, self.chunks)
        targets = split_target(target, [c.rows for c in calls])
        shares = step_shares(loss_fn, self._model, calls, targets, items)
        return self._retrying(lambda: self._step(calls, targets, shares))

    def _step(
        self, calls: list[Call], targets: Sequence[Any], shares: LossShares | ModelLoss
    ) -> Tensor:
        if not torch.is_grad_enabled():
            run = self._run(calls, grad=False, head=loss_head(shares, targets), shares=shares)
            run.execute(self._workers(), FORWARD)
            return joined_loss(run.results(), shares.weights)
        run = self._run(calls, grad=True, head=loss_head(shares, targets), shares=shares)
        params = [p for held in self._params for p in held]
        flat_in = [t for c in calls for t in c.tensors()]
        loss = _StepFunction.apply(self, run, shares.weights, len(flat_in), *flat_in, *params)
        loss.backward()
        return loss.detach()

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """``attempt()``; if a micro-batch left the route it followed, again from the same
        random state and batch-norm statistics with that route forgotten (the call then runs
        under the cut's mode). Nothing was written to ``.grad`` before the forward ended."""
        start = self._rerun.start()
        with committing([self._model]):  # deferred batch norms: the mini-batch's statistics
            try:
                return attempt()
            except PathChanged as changed:
                self._routes.distrust(changed.key)
                reset_all([self._model])
                start.restore()
                return attempt()

    def _step_all(self, run: ProgramRun, shares: Sequence[float]) -> Tensor:
        run.open_backward()
        run.execute(self._workers(), EVERY)
        return joined_loss(run.results(), shares)

    def _run(
        self,
        calls: list[Call],
        *,
        grad: bool,
        head: Any = None,
        shares: LossShares | ModelLoss | None = None,
    ) -> ProgramRun:
        inputs = [c.tensors() for c in calls]
        context = (self._model.training, grad, head is not None, isinstance(shares, ModelLoss))
        cuts = [
            Cut(
                Ledger(),
                self._owner,
                self.devices,
                {id(t): t for t in xs},
                self._routes,
                signature(c.args, c.kwargs, *context),
            )
            for c, xs in zip(calls, inputs)
        ]
        batch = functools.partial(
            Batch,
            callers(self._model, calls, shares),
            cuts,
            head=head,
            weights=shares.weights if head is not None and shares is not None else None,
        )
        if any(d.type == "cpu" for d in self.devices) and grad:
            cpu_malloc.tune()
        return ProgramRun(
            self._stages,
            self._params,
            self._schedule(len(calls)),
            batch,
            self._driver_threads(len(calls)),
            inputs,
            [c.rows for c in calls],
            grad=grad,
            tracer=self.tracer,
            draws=self._draws,
            checkpoint=self.checkpoint,
        )

    def _schedule(self, m: int) -> Schedule:
        return schedule_of_batch(self._layout, m, self.chunks)

    def _workers(self) -> WorkerPool | None:
        if len(self._devices_of_workers) == 1:
            return None
        if self._pool is None:
            self._pool = WorkerPool(self._devices_of_workers, threads=self.threads)
        return self._pool

    def _driver_threads(self, m: int) -> ThreadPoolExecutor:
        self._drivers = driver_pool(self._drivers, m, min(self.threads), self.devices[0])
        return self._drivers

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (transformers' ``GenerationMixin``), every forward call
        of its loop (the prompt, then each new token) run by the pipe; takes and returns what
        the model's ``generate`` does, without gradients. See :mod:`pipepar.program.generation`.

        Example:
            >>> pipe.eval()
            >>> ids = pipe.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=8)
        """
        return generation.generate(self, *args, **kwargs)

    clip_grad_norm_ = Pipe.clip_grad_norm_  # the whole model's norm, as for nn.Sequential

    def close(self) -> None:
        """Stop the worker and driver threads."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._drivers is not None:
            self._drivers.shutdown(wait=False)
            self._drivers = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = state["_drivers"] = None
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class made for a model class is found again from it (pickle cannot by name).
        made_for = type(self).__dict__.get("_model_class")
        if made_for is None:
            return super().__reduce_ex__(protocol)
        return _new_pipe, (made_for,), self.__getstate__()


def _new_pipe(model_class: type[nn.Module]) -> ModelPipe:
    """An empty pipe of ``model_class`` for unpickling to fill in."""
    return ModelPipe.__new__(hf.class_for(ModelPipe, model_class))


# -- building -------------------------------------------------------------------------------
def _call_order(model: nn.Module, sample: Any) -> list[str]:
    return [u.path for u in units_.units(model, sample)]


def _place(
    model: nn.Module,
    lay: units_.Layout,
    stage_of_unit: Sequence[int],
    owner: dict[int, int],
    devices: Sequence[torch.device],
) -> None:
    """Move each parameter to its holder's device, and each unit's buffers to its stage's."""
    for p in model.parameters():
        device = devices[owner.get(id(p), 0)]
        if p.device != device:
            p.data = p.data.to(device)
    for unit, s in zip(lay.units, stage_of_unit):
        for module in unit.module.modules():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.device != devices[s]:
                    module._buffers[name] = b.to(devices[s])


def _stages(
    lay: units_.Layout, stage_of_unit: Sequence[int], devices: Sequence[torch.device]
) -> list[Stage]:
    stages: list[Stage] = []
    start = 0
    for s, device in enumerate(devices):
        mine = list(units_.iter_stage_units(lay, stage_of_unit, s))
        names = [u.path.replace(".", "/") or "model" for u in mine]
        stages.append(ProgramStage(s, start, [u.module for u in mine], device, names=names))
        start += len(mine)
    return stages


def _held(model: nn.Module, owner: dict[int, int], n: int) -> list[list[nn.Parameter]]:
    held: list[list[nn.Parameter]] = [[] for _ in range(n)]
    for p in model.parameters():  # each once, tied ones included once
        if p.requires_grad:
            held[owner.get(id(p), 0)].append(p)
    return held
