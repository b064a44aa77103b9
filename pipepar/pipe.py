"""Pipe: any model split into stages on the devices of one process, its micro-batches run
concurrently on any schedule.

One class for every model. What differs between models is how a micro-batch crosses the
stages, the pipe's *compute*:

- an ``nn.Sequential`` split by ``balance`` is a chain of layers, each stage's output handed to
  the next (:class:`~pipepar.local.chain.ChainCompute`): its units are its layers;
- any other model (or an ``nn.Sequential`` split by module paths) runs its own ``forward``,
  cut into stages while it runs (:class:`~pipepar.program.compute.ProgramCompute`).

Everything else is the pipe's: the schedule, the devices and their worker threads, the
stages, the random-draw record, the timeline, clipping, and the look of the model it wraps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pipepar.batching.calls import StepCall
from pipepar.batching.rules import CHAIN_RULES, InputRule, OutputRule, Rules
from pipepar.core import validation
from pipepar.core.devices import DeviceSpec, resolve_devices
from pipepar.core.garbage import StepCollector
from pipepar.core.given import check_given
from pipepar.core.loss_scale import LossScaler, loss_scale
from pipepar.core.losses import Items, LossFn
from pipepar.core.recompute_placement import check_placement, check_rebuilds
from pipepar.core.schedule import Schedule
from pipepar.core.stage import iter_layers
from pipepar.hf import conventions as hf
from pipepar.local.chain import ChainCompute, chain_step_arguments, is_chain
from pipepar.local.pipe_view import PipeView, check_threads, count_workers, schedule_for
from pipepar.local.placement import StaysPlaced
from pipepar.recording.tracer import Tracer

if TYPE_CHECKING:
    from pipepar.program.compute import ProgramCompute

__all__ = ["Pipe"]


class Pipe(StaysPlaced):
    """Any model split into stages on several devices, called like the model.

    Build one with :func:`pipepar.wrap`. The pipe's children are the model's, so
    ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` use exactly the plain
    model's keys (a checkpoint of the plain model loads into the pipe and back), and a tied
    weight is listed once. Calling it splits the batch into ``chunks`` micro-batches, runs
    their forwards through the stages concurrently (one worker thread per device) and returns
    what the model returns, joined; ``backward()`` runs the stages' backward actions
    concurrently too. :meth:`step` runs forward and backward together in the schedule's own
    order, so 1F1B and the zero-bubble schedules keep their memory bound and fill their
    bubbles. ``len(pipe)``, ``pipe[i]`` and ``list(pipe)`` are the model's units (an
    ``nn.Sequential``'s layers).

    To whatever inspects a model (HF ``Trainer``, ``accelerate``) the pipe of a model looks
    like it: its class is made for the model's class and its ``forward`` has the model's
    signature, an attribute it lacks is the model's (``__getattr__``), ``hf_device_map`` says
    where its units sit, and ``to(device)`` is a no-op where every stage is there already.

    Args:
        module: the model to split (an ``nn.Sequential``, or any ``nn.Module``).
        balance: units per stage (an ``nn.Sequential``'s layers; :func:`pipepar.units` lists
            a model's units); or
        split: module paths where a new stage begins, e.g. ``["transformer.h.6"]``.
        devices: one device per stage (per device for the virtual-stage schedules).
        chunks: micro-batches per mini-batch.
        sample: an example call (a tensor, a tuple of positional arguments, or a dict of
            keyword arguments): a model's units are then ordered as the model calls them.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which micro-batches the
            stages recompute in backward; default ``"except_last"`` for an ``nn.Sequential``
            (as torchgpipe), ``"never"`` for other models.
        deferred_batch_norm: batch-norm layers track their running statistics over the whole
            mini-batch, once per call (:mod:`pipepar.core.batchnorm`), not per micro-batch.
        schedule: a schedule name or object (:mod:`pipepar.core.schedule`).
        recompute: where checkpointed micro-batches recompute: ``"in_place"`` inside their
            backward, or ``"bubbles"``: as ``R`` actions placed in the workers' idle time
            before the backward, holding no more rebuilt micro-batches at once than in place
            (:mod:`pipepar.core.recompute_placement`); a model cut while it runs recomputes its
            checkpointed units there (:mod:`pipepar.program.unit_calls`).
        threads: math threads per CPU stage.
        trace: record a timeline in ``pipe.tracer``.
        gc_every: Python's cycle collector during :meth:`step`: ``None`` leaves it as it is;
            ``N`` turns it off while a step runs, collects what the step left after it and
            runs a full collection every ``N`` steps (:mod:`pipepar.core.garbage`).
        offload: send what a micro-batch's forward saves for its backward to host memory
            while the stage runs other actions, and bring it back one action before its
            backward, as the schedule says (:mod:`pipepar.core.offload_plan`); on CUDA the
            copies run on a side stream into pinned memory. Results are unchanged. With
            ``checkpoint`` unset, nothing is recomputed (``"never"``): offload, not recompute,
            keeps the activations' memory down.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        >>> pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=2)
        >>> pipe.balance, len(pipe), list(pipe.state_dict())[:2]
        ([2, 2], 4, ['0.weight', '0.bias'])
        >>> pipe(torch.randn(4, 8)).sum().backward()  # GPipe order, like the plain model
        >>> loss = pipe.step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    """

    _model: nn.Module  # not a child: its children are the pipe's
    _model_class: type[nn.Module] | None = None  # set on the class made for a model class
    _signed_class: type[nn.Module] | None = None  # and the class its forward is signed as
    hf_device_map: dict[str, int | str]
    is_parallelizable: bool
    model_parallel: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> Pipe:
        """The pipe of a model other than a chain is an instance of the Pipe subclass made for
        the model's class, named as it, whose ``forward`` shows the model's signature (that of
        the module it passes its call to, where its own forward takes only ``*args`` and
        ``**kwargs``: :func:`pipepar.hf.conventions.signing_class`)."""
        model = args[0] if args else kwargs.get("module")
        chain = is_chain(model, kwargs.get("split"), kwargs.get("sample"))
        if cls is Pipe and isinstance(model, nn.Module) and not chain:
            return super().__new__(hf.class_for(Pipe, type(model), hf.signing_class(model)))
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        balance: Sequence[int] | None = None,
        *,
        split: Sequence[str] | None = None,
        devices: DeviceSpec = None,
        chunks: int = 1,
        sample: Any = None,
        checkpoint: str | None = None,
        deferred_batch_norm: bool = False,
        batch_coupling: str = "error",
        split_inputs: Mapping[str | int, InputRule] | None = None,
        join_outputs: Mapping[str, OutputRule] | None = None,
        schedule: str | Schedule = "gpipe",
        recompute: str = "in_place",
        threads: int | None = None,
        trace: bool = False,
        gc_every: int | None = None,
        offload: bool = False,
    ) -> None:
        super().__init__()
        self._collector = StepCollector(gc_every)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"module must be an nn.Module, but got {type(module).__name__}; "
                "pass the model to split"
            )
        self.chunks = validation.check_chunks(chunks)
        self.offload = validation.check_offload(offload)
        if checkpoint is not None:
            checkpoint = validation.check_checkpoint(checkpoint)
        chain = is_chain(module, split, sample)
        rules = Rules.given(split_inputs, join_outputs)
        if chain and rules:
            raise TypeError(CHAIN_RULES)
        compute: ChainCompute | ProgramCompute
        if chain:
            compute = ChainCompute(
                module,
                balance,
                deferred_batch_norm=deferred_batch_norm,
                batch_coupling=batch_coupling,
            )
        else:  # the cut loads with the first model that is not a chain
            from pipepar.program.compute import ProgramCompute

            compute = ProgramCompute(
                module,
                balance,
                split=split,
                sample=sample,
                deferred_batch_norm=deferred_batch_norm,
                batch_coupling=batch_coupling,
                rules=rules,
            )
        # Offload keeps activations instead of recomputing them, unless told to recompute too.
        self.checkpoint = checkpoint or ("never" if self.offload else compute.default_checkpoint)
        self.recompute = check_placement(recompute, self.checkpoint)
        workers = resolve_devices(devices, count_workers(schedule, compute.sizes, devices))
        # The schedule asked for (a name's built for one micro-batch): where the stages are
        # placed, checked now; each batch's is rebuilt for its count (``_schedule``).
        asked = schedule_for(schedule, len(compute.sizes), self.chunks, len(workers))
        check_rebuilds(asked, self.checkpoint)
        placed = [workers[w] for w in asked.placement]
        stages = compute.place(placed, self.checkpoint)
        # The model's children first: a layer may have the name of a property that reads the
        # stages (``partitions``), which ``add_module`` must not find yet.
        self._adopt(compute.model)
        self._compute = compute
        self.threads = check_threads(threads, workers, self.chunks)
        self.tracer: Tracer | None = Tracer() if trace else None
        # What the compute runs on: the stages, the workers, each batch's schedule.
        self._view = PipeView(self, stages, asked, workers)
        # Placed already, across devices or not: Trainer and accelerate leave it where it is.
        where = [s.device for s in self._view.stages for _ in s.layers]
        self.hf_device_map = hf.device_map(compute.paths, where)
        self.is_parallelizable = self.model_parallel = hf.spans_devices(placed)

    def _adopt(self, model: nn.Module) -> None:
        """The model's children, own parameters and buffers become the pipe's (its keys)."""
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        # Set after the children: until then no name falls back to the model (__getattr__).
        object.__setattr__(self, "_model", model)

    # -- what the pipe is ---------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._model

    @property
    def balance(self) -> list[int]:
        """Units (an ``nn.Sequential``'s layers) per stage."""
        return [len(s.layers) for s in self._view.stages]

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device."""
        return [s.device for s in self._view.stages]

    @property
    def stage_paths(self) -> list[list[str]]:
        """The names (module paths) of each stage's units."""
        return [[n.replace("/", ".") for n in s.names or []] for s in self._view.stages]

    @property
    def partitions(self) -> nn.ModuleList:
        """The stage modules that run (hooks on them fire); not children of the pipe, so the
        state_dict keys stay the plain model's."""
        return nn.ModuleList([s.module for s in self._view.stages])

    def __len__(self) -> int:
        return sum(len(s.layers) for s in self._view.stages)

    def __iter__(self) -> Iterator[nn.Module]:
        yield from iter_layers(self._view.stages)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = list(self)
        return nn.Sequential(*layers[index]) if isinstance(index, slice) else layers[index]

    @property
    def schedule(self) -> Schedule:
        """The schedule of a full mini-batch (``chunks`` micro-batches)."""
        return self._view.schedule(self.chunks)

    def extra_repr(self) -> str:
        starts = [paths[0] for paths in self.stage_paths if paths]
        return (
            f"balance={self.balance}, stages start at {starts}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}, schedule={self._view.asked.name!r}"
        )

    def train(self, mode: bool = True) -> Pipe:
        super().train(mode)
        self._model.train(mode)  # the model's own flag, read by its forward
        return self

    # -- placement is the pipe's job (StaysPlaced: to(device), cuda(), cpu()) --------------
    def stage_devices(self) -> list[torch.device]:
        return self.devices

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
        return what the model returns, joined over the micro-batches (an ``nn.Sequential``'s
        output on the last stage's device).

        The forwards run now and the backwards when ``backward()`` reaches the pipe (each in
        the schedule's order): the activations of every micro-batch are held in between, as
        under GPipe. Use :meth:`step` for a schedule's own memory bound.
        """
        return self._compute.forward(self._view, args, kwargs)

    def step(
        self,
        *args: Any,
        loss_fn: LossFn | None = None,
        target: Any = None,
        items: Items | None = None,
        scaler: LossScaler | None = None,
        microbatches: list[Any] | None = None,
        targets: list[Any] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Forward and backward of one mini-batch in the schedule's order; returns the loss.

        An ``nn.Sequential``'s pipe takes ``step(input, target, loss_fn)`` (positionally or
        by name); any other model's takes the model's own arguments, and ``loss_fn=`` and
        ``target=`` by name. The loss is what ``loss_fn(output, target)`` returns for each
        micro-batch or, without ``loss_fn``, the model's own (``output.loss``, or the first
        element of a tuple, as transformers models return when given ``labels=``). The last
        stage applies it to each micro-batch as soon as its forward is done, so its backward
        can start at once: under ``"1f1b"`` stage ``j`` holds at most ``K - j``
        micro-batches, and the zero-bubble schedules fill idle time with deferred weight
        gradients.

        The micro-batch losses are joined into exactly the loss of the whole batch, whatever
        it averages over: rows, real targets (``-100`` labels, ``ignore_index``, class
        weights), nothing for ``reduction="sum"``, or a count passed as
        ``num_items_in_batch`` (see :mod:`pipepar.core.losses` and
        :mod:`pipepar.program.losses`); ``items(target_i)`` tells what a custom ``loss_fn``
        averages over, e.g. ``lambda y: (y != pad).sum()``. Gradients accumulate into
        ``.grad`` exactly as with the plain model's loss ``.backward()``. ``step`` runs the
        backward itself, so wrap the pipe in ``DistributedDataParallel`` only with
        ``pipe(x)`` + ``backward()``; for pipeline x data parallel use
        :mod:`pipepar.distributed` (``dp=``), which runs every schedule.

        ``scaler=`` (a ``torch.amp.GradScaler``) scales the loss as the plain model's
        ``scaler.scale(loss).backward()`` does: every micro-batch's backward starts from its
        share times the scaler's scale (:mod:`pipepar.core.loss_scale`). The loss returned is
        unscaled; ``scaler.unscale_(opt)``, :meth:`clip_grad_norm_`, ``scaler.step(opt)`` and
        ``scaler.update()`` follow as with the plain model.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` it evaluates: only the
        forward actions of the schedule run, the same loss comes back, ``.grad`` is untouched
        and no activation is kept for a backward (call ``pipe.eval()`` first for dropout off).

        ``microbatches=[mb0, mb1, ...]`` runs micro-batches you made instead of splitting a
        batch (e.g. sequences of different lengths, bucketed): each ``mb`` is what the model
        takes (a dict of keyword arguments or a tuple of positional ones; for an
        ``nn.Sequential`` its input), and they may differ in rows and in any other size.
        The schedule is built for ``len(microbatches)`` (a Schedule object must have that
        many). With ``loss_fn=``, ``targets=[t0, t1, ...]`` gives each one's target. The loss
        and gradients are those of one loss over all of them, joined as above: a mean over
        tokens is the mean over every micro-batch's tokens. Without ``microbatches=``,
        ``targets=`` is the model's own keyword argument (nanoGPT's ``forward(idx, targets)``).

        Args:
            *args: the batch: an ``nn.Sequential``'s ``(input, target, loss_fn)``, or the
                model's own positional arguments.
            loss_fn: ``loss_fn(output, target)`` for each micro-batch; None for the model's
                own loss.
            target: the whole batch's target, cut into micro-batches like the input.
            items: ``items(target_i)``: what a custom ``loss_fn`` averages over in one
                micro-batch (e.g. its real tokens), when the probe cannot learn it.
            scaler: a ``torch.amp.GradScaler`` whose scale every backward starts from.
            microbatches: micro-batches you made, instead of a batch to cut.
            targets: with ``microbatches`` and ``loss_fn``: each micro-batch's target.
            **kwargs: the model's own keyword arguments (``input_ids=..., labels=...``).

        Returns:
            The loss of the whole batch, as the plain model's loss on that batch; the
            gradients are accumulated into ``.grad``.

        Raises:
            LossNotJoinable: the loss is neither a sum nor a mean over a count of the batch
                (found on micro-batch 0, before any gradient).
            BatchCoupled: the model mixes rows of the batch (found on the first call of a
                kind, before any gradient).
            TypeError: arguments that do not go together (``microbatches`` and a batch,
                ``targets`` without ``loss_fn``); the message names them and the fix.
            ValueError: a batch that does not fit the pipe (a Schedule object built for
                another number of micro-batches, fewer rows than micro-batches it needs).

        Example:
            >>> loss = pipe.step(x, y, nn.functional.mse_loss)  # an nn.Sequential
            >>> loss = pipe.step(input_ids=ids, labels=ids)  # a transformers model
            >>> loss = pipe.step(microbatches=[{"input_ids": a, "labels": a},
            ...                                {"input_ids": b, "labels": b}])
            >>> opt.step(); opt.zero_grad()
            >>> loss = pipe.step(x, y, loss_fn, scaler=scaler)  # fp16: scaled backward
            >>> scaler.step(opt); scaler.update(); opt.zero_grad()
            >>> with torch.no_grad():
            ...     val_loss = pipe.eval().step(input_ids=val_ids, labels=val_ids)
        """
        given, kwargs = check_given(
            microbatches, targets, loss_fn=loss_fn, target=target, args=args, kwargs=kwargs
        )
        scale = loss_scale(scaler, self._view.stages[-1].device)
        with self._collector.step():
            if isinstance(self._compute, ChainCompute):
                call = chain_step_arguments(args, kwargs, target, loss_fn, items, given=given)
                return self._compute.step(self._view, replace(call, scale=scale))
            step_call = StepCall(args, kwargs, loss_fn, target, items, scale, given)
            return self._compute.step(self._view, step_call)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (transformers' ``GenerationMixin``), every forward call
        of its loop (the prompt, then each new token) run by the pipe; takes and returns what
        the model's ``generate`` does, without gradients. See :mod:`pipepar.hf.generation`.

        Example:
            >>> pipe.eval()
            >>> ids = pipe.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=8)
        """
        from pipepar.hf.generation import generate

        return generate(self, *args, **kwargs)

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
        """Stop the worker (and driver) threads now; they also stop when the pipe is
        garbage-collected."""
        self._view.close()
        self._compute.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class made for a model class is found again from it (pickle cannot by name).
        made_for = type(self).__dict__.get("_model_class")
        if made_for is None:
            return super().__reduce_ex__(protocol)
        signed = type(self).__dict__.get("_signed_class")
        return _new_pipe, (made_for, signed), self.__getstate__()


def _new_pipe(model_class: type[nn.Module], signed: type[nn.Module] | None = None) -> Pipe:
    """An empty pipe of ``model_class`` (signed as ``signed``) for unpickling to fill in."""
    return Pipe.__new__(hf.class_for(Pipe, model_class, signed))
