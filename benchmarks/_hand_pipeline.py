"""A pipeline written by hand: the floor of what a schedule costs in torch calls.

The benchmarks compare each library's host time with this one: the stages' layers called
directly, each activation sent with ``dist.isend`` and received with ``dist.recv``, each
gradient sent back the same way; no checks, no hooks, no threads. It plays the action order of
pipepar's own schedule of the same name (``named_schedules.make``: only the order, not pipepar's
executor), stage ``s`` on the rank that schedule places it on, so the hand-written 1F1B and
ZB-V do exactly the work, in exactly the order, that pipepar's do. With ``serial=True`` it
plays every worker's actions on the calling thread instead (no messages): the torch calls alone.

Without W actions (gpipe, 1f1b) a B is plain ``backward()``. With them (zb-v) the stage's
backward is split as a zero-bubble schedule needs it, the simplest way that computes no product
twice: B is one ``torch.autograd.grad`` from the stage's output to its input and to the output of
each ``nn.Linear`` (autograd then skips every weight product), W computes each Linear's weight
gradient from what B left, ``grad^T @ input``, and its bias gradient ``grad.sum(0)``, summed into
``.grad``. It is written for the benchmark's Linear + ReLU stacks only (a stage holding a layer
with parameters that is not a Linear is refused). ``weights="terms-read"`` does the same and, in
each B of a stage with an input gradient, also reads the stage's graph as pipepar's split does
(:class:`~pipepar.core.backward_plans.BackwardPlans`, its plan then unused): what a library that
does not know the stage's layers must pay to find where the weight gradients leave the graph.

:func:`check_gradients` runs one step and compares every local gradient with the plain model's on
the whole batch, so a hand-written contender is timed only once it computes the right numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks import _common as common
from benchmarks._contenders import pipepar_balance
from pipepar.core import named_schedules
from pipepar.core.backward_plans import BackwardPlans
from pipepar.core.split_backward import by_id

__all__ = ["check_gradients", "hand_written"]

Run = Callable[[Tensor, Tensor], None]
_Record = tuple[nn.Linear, Tensor, Tensor]  # a Linear, its input, its output


@dataclass
class _Step:
    """What one step of one rank keeps between its actions."""

    xs: list[Tensor]
    ys: list[Tensor]
    split: str | None  # None (no W), "terms" or "autograd": how W computes
    saved: dict[tuple[int, int], tuple[Tensor, Tensor, list[_Record]]] = field(default_factory=dict)
    local: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)  # same-rank handoffs
    grads: dict[tuple[int, int], tuple[Tensor, ...]] = field(default_factory=dict)  # for W
    sends: list[Any] = field(default_factory=list)
    plans: dict[int, BackwardPlans] | None = None  # "terms-read": each stage's graph read in B


def hand_written(
    model: nn.Sequential,
    schedule: str,
    rank: int,
    world: int,
    m: int,
    loss: common.Loss,
    weights: str = "terms",
    *,
    serial: bool = False,
) -> tuple[Run, nn.Module]:
    """``(run(x, y), this rank's layers)``: ``schedule`` (a pipepar schedule name: gpipe, 1f1b,
    zb-v, ...) played by hand on this rank, pipepar's balance of ``model``'s layers.

    ``serial``: no ranks: every worker's stages on the calling thread, in the schedule's
    ``serial`` order, each stage's output handed to the next directly (``rank`` is ignored):
    the schedule's torch calls alone, without messages or a second thread.

    ``weights``: how a schedule with W actions splits a stage's backward: ``"terms"`` (B one
    pass to the input and each Linear's output, W the Linear terms) or ``"autograd"`` (B
    ``autograd.grad(output, input, grad, retain_graph=True)``, W ``autograd.grad(output,
    parameters, grad)``: two engine passes, the weight path's products done twice) or
    ``"terms-read"`` (``"terms"``, each B also reading its stage's graph as pipepar does)."""
    if weights not in ("terms", "autograd", "terms-read"):
        raise ValueError(f"weights must be 'terms', 'autograd' or 'terms-read', not {weights!r}")
    order = named_schedules.make(
        schedule, world * (2 if schedule in named_schedules.VIRTUAL else 1), m, n_workers=world
    )
    bal, layers = pipepar_balance(schedule, len(model), world), list(model)
    parts = [nn.Sequential(*layers[sum(bal[:i]) : sum(bal[: i + 1])]) for i in range(len(bal))]
    if serial:
        rank, actions, owner = 0, order.serial, (0,) * len(parts)
    else:
        actions, owner = order.actions[rank], order.placement
    mine = {s: parts[s] for s in range(len(parts)) if owner[s] == rank}
    reads = weights == "terms-read"
    splits = any(a.kind == "W" for w in order.actions for a in w)
    split = ("terms" if reads else weights) if splits else None
    if split == "terms":
        _only_linear_parameters(mine)
    plans = None  # kept across steps, as a pipe keeps its stages' plans
    if split and reads:
        plans = {s: BackwardPlans(by_id(list(part.parameters()))) for s, part in mine.items()}
    last = len(bal) - 1

    def share(out: Tensor, target: Tensor) -> Tensor:
        return loss(out, target) / m

    def run(x: Tensor, y: Tensor) -> None:
        state = _Step(list(x.tensor_split(m)), list(y.tensor_split(m)), split, plans=plans)
        for a in actions:
            s, i = a.stage, a.microbatch
            if a.kind == "F":
                _forward(state, mine[s], s, i, owner, last, rank, share)
            elif a.kind == "B":
                _backward(state, s, i, owner, last, rank)
            else:
                _weights(state, mine[s], s, i)
        for work in state.sends:
            work.wait()

    return run, nn.ModuleList(mine.values())


def _forward(
    state: _Step,
    part: nn.Sequential,
    s: int,
    i: int,
    owner: tuple[int, ...],
    last: int,
    rank: int,
    loss: common.Loss,
) -> None:
    """Stage ``s``'s forward of micro-batch ``i``: its input from the data, this rank or the
    previous stage's rank; its output to the next stage (or the loss on the last)."""
    if s == 0:
        x = state.xs[i]
    elif owner[s - 1] == rank:
        x = state.local.pop(("F", s, i)).requires_grad_(True)
    else:
        x = torch.empty(state.xs[i].shape[0], _in_features(part))
        dist.recv(x, owner[s - 1], tag=2 * (s - 1))
        x.requires_grad_(True)
    h, records = x, []
    for layer in part:
        out = layer(h)
        if isinstance(layer, nn.Linear):
            records.append((layer, h, out))
        h = out
    if s == last:
        h = loss(h, state.ys[i])
    elif owner[s + 1] == rank:
        state.local[("F", s + 1, i)] = h.detach()
    else:
        state.sends.append(dist.isend(h.detach(), owner[s + 1], tag=2 * s))
    state.saved[(s, i)] = (x, h, records)


def _backward(state: _Step, s: int, i: int, owner: tuple[int, ...], last: int, rank: int) -> None:
    """Stage ``s``'s B of micro-batch ``i``: the whole backward, or (a split) the input's
    gradient, with each Linear output's (``"terms"``); the input's gradient to the previous
    stage."""
    x, out, records = state.saved[(s, i)] if state.split else state.saved.pop((s, i))
    grad = None
    if s < last:
        if owner[s + 1] == rank:
            grad = state.local.pop(("B", s, i))
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, owner[s + 1], tag=2 * (s + 1) + 1)
    if state.plans is not None and s > 0:  # where pipepar's split reads the graph
        state.plans[s].plan([out], [torch.ones_like(out) if grad is None else grad], [x])
    if state.split == "terms":
        wanted = ([x] if s > 0 else []) + [z for _, _, z in records]
        got = torch.autograd.grad(out, wanted, grad)
        state.grads[(s, i)] = got[len(got) - len(records) :]
        gx = got[0] if s > 0 else None
    elif state.split == "autograd":
        gx = torch.autograd.grad(out, [x], grad, retain_graph=True)[0] if s > 0 else None
        state.grads[(s, i)] = () if grad is None else (grad,)
    else:
        torch.autograd.backward(out, grad)
        gx = x.grad
    if s == 0:
        return
    assert gx is not None  # a later stage's input requires its gradient
    if owner[s - 1] == rank:
        state.local[("B", s - 1, i)] = gx
    else:
        state.sends.append(dist.isend(gx, owner[s - 1], tag=2 * s + 1))


def _weights(state: _Step, part: nn.Module, s: int, i: int) -> None:
    """Stage ``s``'s W of micro-batch ``i``: each Linear's weight and bias gradient from its
    saved input and the gradient B found at its output (``"autograd"``: an engine pass from the
    stage's output to its parameters), summed into ``.grad``."""
    _, out, records = state.saved.pop((s, i))
    if state.split == "autograd":
        params, grad = list(part.parameters()), state.grads.pop((s, i))
        for p, g in zip(params, torch.autograd.grad(out, params, grad or None)):
            p.grad = g if p.grad is None else p.grad.add_(g)
        return
    for (layer, h, _), g in zip(records, state.grads.pop((s, i))):
        _accumulate(layer.weight, g.t(), h)
        if layer.bias is not None:
            bias = g.sum(0)
            layer.bias.grad = bias if layer.bias.grad is None else layer.bias.grad.add_(bias)


def _accumulate(weight: Tensor, g_t: Tensor, h: Tensor) -> None:
    if weight.grad is None:
        weight.grad = g_t @ h
    else:
        weight.grad.addmm_(g_t, h)


def _only_linear_parameters(parts: dict[int, nn.Sequential]) -> None:
    for part in parts.values():
        for layer in part:
            if not isinstance(layer, nn.Linear) and any(True for _ in layer.parameters()):
                raise ValueError(
                    f"the hand-written split backward computes Linear weight gradients only, "
                    f"but the stage holds a {type(layer).__name__} with parameters; use a "
                    "schedule without W (gpipe, 1f1b)"
                )


def _in_features(part: nn.Sequential) -> int:
    """The input features of ``part``'s first Linear layer."""
    linear = next(layer for layer in part if isinstance(layer, nn.Linear))
    return linear.in_features


def check_gradients(
    run: Run, mine: nn.Module, model: nn.Sequential, x: Tensor, y: Tensor, loss: common.Loss
) -> None:
    """One step of ``run``; each of ``mine``'s gradients must match the plain ``model``'s on the
    whole batch (``allclose``), else ValueError. ``mine``'s gradients are let go afterwards."""
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    loss(plain(x), y).backward()
    reference = {id(q): p.grad for q, p in zip(model.parameters(), plain.parameters())}
    mine.zero_grad(set_to_none=True)
    run(x, y)
    for p in mine.parameters():
        want, got = reference[id(p)], p.grad
        if got is None or want is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            diff = (
                "no gradient"
                if got is None or want is None
                else f"{(got - want).abs().max().item():.2e}"
            )
            raise ValueError(
                f"the hand-written pipeline's gradients differ from the model's by {diff}"
            )
    mine.zero_grad(set_to_none=True)
