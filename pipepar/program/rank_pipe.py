"""DistributedModelPipe: any model split over the ranks of a pipeline (``pipepar.distributed``).

See :mod:`pipepar.program.ranks` for how a rank follows the stages it does not compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.core import validation
from pipepar.core.schedule import VIRTUAL, Schedule, make
from pipepar.core.stage import Stage
from pipepar.distributed.mesh import build_mesh, check_grid
from pipepar.distributed.pipe import _ensure_process_group, _resolve_device
from pipepar.program import units as units_
from pipepar.program.calls import split_call
from pipepar.program.cut import Ledger
from pipepar.program.driver import driver_pool, mark_boundaries
from pipepar.program.losses import LossFn, loss_head, split_target
from pipepar.program.meta_values import MetaScalars
from pipepar.program.pipe import _sizes
from pipepar.program.ranks import Link, RankCut, RankStep, held_here, shadow_context
from pipepar.program.step import Batch

__all__ = ["DistributedModelPipe"]


class DistributedModelPipe(nn.Module):
    """This rank's stage of any model split over the ranks of a pipeline, with ``dp`` replicas.

    Build it with :func:`pipepar.distributed.wrap` on every rank, with the same arguments. The
    rank keeps only the weights its stage uses (a weight tied across stages on every rank that
    uses it): build the model on the ``meta`` device and pass ``state_dict``, or build it real
    and the other stages' weights are dropped. ``parameters()`` and ``state_dict()`` cover the
    rank's own weights under the model's names.
    """

    _model: nn.Module  # not a child: its children are the pipe's

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        *,
        split: Sequence[str] | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        dp: int = 1,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        timeout: float = 300.0,
    ) -> None:
        super().__init__()
        self.chunks = validation.check_chunks(chunks)
        lay = units_.layout(model)
        sizes = _sizes(lay, balance, split)
        if (isinstance(schedule, str) and schedule in VIRTUAL) or (
            isinstance(schedule, Schedule) and schedule.n_workers != len(sizes)
        ):
            raise ValueError(
                f"schedule {getattr(schedule, 'name', schedule)!r} puts several stages on a "
                "rank, which pipepar.distributed runs for nn.Sequential models only; pass "
                "schedule='gpipe', '1f1b' or 'zb-h1' for this model"
            )
        self.schedule = make(schedule, len(sizes), self.chunks, n_workers=len(sizes))
        _ensure_process_group()
        self.dp = check_grid(dist.get_world_size(group), len(sizes), dp)
        self.device = _resolve_device(device, group)
        self.mesh = build_mesh(
            len(sizes),
            self.dp,
            group=group,
            timeout=timedelta(seconds=timeout),
            placement=self.schedule.placement,
        )
        own = self.mesh.stage
        self.stage_of_unit = [s for s, n in enumerate(sizes) for _ in range(n)]
        object.__setattr__(self, "_model", model)
        self._own = own
        self._owner = units_.owners(lay, self.stage_of_unit)
        held = held_here(model, lay.units, self.stage_of_unit, own)
        held += [p for _, p in lay.loose if self._owner[id(p)] == own]
        held = list({id(p): p for p in held}.values())
        self._held = _keep_only(model, held, self.device, state_dict)
        lay = self._units = units_.layout(model)  # the same units, with the new parameters
        self._owner = {id(p): own for p in self._held}
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self._hooks = mark_boundaries(lay.units, self.stage_of_unit)
        self._tied = _tied_groups(model, lay, self.stage_of_unit, self.mesh.pipeline_ranks)
        mine = [u for u, s in zip(lay.units, self.stage_of_unit) if s == own]
        self._stage = Stage(
            own,
            0,
            [u.module for u in mine],
            self.device,
            names=[u.path.replace(".", "/") for u in mine],
        )
        self._link = Link(self.mesh.pipeline_ranks, self.device)
        self._drivers: ThreadPoolExecutor | None = None
        if self.mesh.dp_group is not None and state_dict is None:
            for p in self._held:
                dist.broadcast(p.data, self.mesh.replica_ranks[0], group=self.mesh.dp_group)

    # -- what this rank holds -------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        """This rank's weights (each once)."""
        return iter(self._held)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        held = {id(p) for p in self._held}
        return ((n, p) for n, p in super().named_parameters(*args, **kwargs) if id(p) in held)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        full = super().state_dict(*args, **kwargs)
        return {k: v for k, v in full.items() if not v.is_meta}

    @property
    def stage_index(self) -> int:
        return self._own

    # -- running ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a rank holds one stage, so pipe(...) cannot run the model; call "
            "pipe.step(**batch) for a training step"
        )

    def step(
        self, *args: Any, loss_fn: LossFn | None = None, target: Any = None, **kwargs: Any
    ) -> float:
        """Forward and backward of one mini-batch; returns the loss on every rank.

        Call it on every rank of the pipeline with the same arguments (the batch the model
        takes: e.g. ``input_ids=..., labels=...``); each replica with its own batch. The loss is
        the model's own (``labels=``) or ``loss_fn(output, target)``, micro-batches weighted by
        their rows. Gradients accumulate into ``.grad``, summed over the stages that share a
        tied weight and averaged over the replicas.
        """
        calls = split_call(args, kwargs, self.chunks)
        rows = [c.rows for c in calls]
        weights = [r / sum(rows) for r in rows]
        head = loss_head(loss_fn, split_target(target, rows))
        values = [MetaScalars() for _ in calls]
        cuts = [
            RankCut(
                Ledger(),
                self._owner,
                [self.device] * self.schedule.n_stages,
                {},
                own=self._own,
                link=self._link,
                values=vals,
            )
            for vals in values
        ]
        shadow = shadow_context(values, True)

        def context(stage: int, i: int) -> contextlib.AbstractContextManager[Any]:
            # ``step`` is made below, before any driver runs.
            return step.segment_context(stage, i) if stage == self._own else shadow(stage, i)

        batch = Batch(
            [_caller(self._model, c) for c in calls], cuts, context, head=head, weights=weights
        )
        step = RankStep(
            self._stage,
            len(calls),
            batch=batch,
            params=[p for p in self._held if p.requires_grad],
            checkpoint="never",
            grad=True,
            input_grad=True,
            streams=None,  # one driver computes at a time: draws in order
            split=lambda i: self.schedule.splits_backward(self._own, i),
            cuts=cuts,
            link=self._link,
        )
        pool = self._driver_threads(len(calls))
        for driver in batch.drivers:
            pool.submit(driver.run)
        try:
            for action in self.schedule.worker(self._own):
                kind, i = action.kind, action.microbatch
                if kind == "F":
                    step.forward(i, ())
                elif kind == "B":
                    step.backward(i, ())
                else:
                    step.weight(i)
        except BaseException:
            batch.abort()
            raise
        self._link.flush()
        self._write_grads(step)
        return self._loss(batch, weights)

    def _write_grads(self, step: RankStep) -> None:
        for p, g in zip(step.params, step.param_grads()):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        step.release()
        for group, params in self._tied:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        if self.mesh.dp_group is not None:
            for p in self._held:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.mesh.dp_group)
                    p.grad /= self.dp

    def _loss(self, batch: Batch, weights: list[float]) -> float:
        last = self.schedule.n_stages - 1
        value = torch.zeros(1, device=self.device)
        if self._own == last:
            total = sum(w * d.result.detach().float() for w, d in zip(weights, batch.drivers))
            value += total
        if self.mesh.ctl is not None:
            dist.all_reduce(value, group=self.mesh.ctl)
        if self.mesh.dp_group is not None:
            dist.all_reduce(value, group=self.mesh.dp_group)
            value /= self.dp
        return float(value.item())

    def _driver_threads(self, m: int) -> ThreadPoolExecutor:
        self._drivers = driver_pool(self._drivers, m, torch.get_num_threads(), self.device)
        return self._drivers

    def close(self) -> None:
        if self._drivers is not None:
            self._drivers.shutdown(wait=False)
            self._drivers = None
        self.mesh.close()


def _caller(model: nn.Module, call: Any) -> Any:
    return lambda: model(*call.args, **call.kwargs)


def _keep_only(
    model: nn.Module,
    held: list[nn.Parameter],
    device: torch.device,
    state_dict: Mapping[str, Tensor] | None,
) -> list[nn.Parameter]:
    """Put the weights this rank holds on ``device`` (from ``state_dict`` if given) and the
    others on ``meta``; return the held ones (new objects, tied ones still shared)."""
    mine = {id(p) for p in held}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    new: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        new[id(p)] = nn.Parameter(
            _value(p, names[id(p)], id(p) in mine, device, state_dict), p.requires_grad
        )
    for module in model.modules():
        for name, old in list(module._parameters.items()):
            if old is not None:
                module._parameters[name] = new[id(old)]
    _place_buffers(model, device)
    return [new[id(p)] for p in held]


def _value(
    p: nn.Parameter,
    name: str,
    mine: bool,
    device: torch.device,
    state_dict: Mapping[str, Tensor] | None,
) -> Tensor:
    if not mine:
        return torch.empty_like(p.data, device="meta")
    if state_dict is not None:
        return state_dict[name].detach().to(device, dtype=p.dtype).clone()
    if p.is_meta:
        raise ValueError(
            f"parameter {name} is on the meta device and no state_dict was given; pass "
            "state_dict=<the model's weights>, or build the model on a real device"
        )
    return p.data.to(device)


def _place_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_meta:
                raise ValueError(
                    f"buffer {name} of {type(module).__name__} is on the meta device; build "
                    "the model on a real device (weights of other stages are dropped) or load "
                    "the buffer before wrapping"
                )
            if b is not None:
                module._buffers[name] = b.to(device)


def _tied_groups(
    model: nn.Module,
    lay: units_.Layout,
    stage_of_unit: Sequence[int],
    ranks: Sequence[int],
) -> list[tuple[dist.ProcessGroup, list[nn.Parameter]]]:
    """A process group per set of stages sharing weights (every rank makes every group, in
    the same order, as torch.distributed requires); this rank's part of them."""
    users: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for unit, s in zip(lay.units, stage_of_unit):
        for p in unit.module.parameters():
            users.setdefault(id(p), set()).add(s)
            params[id(p)] = p
    shared: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for key, using in users.items():
        if len(using) > 1:
            shared.setdefault(tuple(sorted(using)), []).append(params[key])
    me = dist.get_rank()
    out = []
    for stages, ps in shared.items():
        members = [ranks[s] for s in stages]
        group = dist.new_group(members)
        if me in members and isinstance(group, dist.ProcessGroup):
            out.append((group, ps))
    return out
