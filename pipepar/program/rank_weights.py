"""What a rank of a pipe of any model across ranks (:mod:`pipepar.program.rank_compute`)
holds: the weights of its own stages on its device (the others' on ``meta``), each with the own
stage that holds it, and a process group per set of weights tied across stages of several ranks.

Weights only: how the stages compute with them is :mod:`pipepar.program.ranks`'s business.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.program.units import ModelUnits, owners

__all__ = ["holders", "keep_only", "tied_groups", "weight_stages"]


def holders(
    lay: ModelUnits, stage_of_unit: Sequence[int], mine: Collection[int]
) -> list[tuple[nn.Parameter, int]]:
    """The parameters a rank of the stages ``mine`` holds, each once with the own stage that
    holds it: those its stages' units use, by the first of those stages (the later ones use
    an alias), and the loose ones its stages own."""
    found: dict[int, tuple[nn.Parameter, int]] = {}
    for unit, s in zip(lay.units, stage_of_unit):
        if s in mine:
            for p in unit.module.parameters():
                found.setdefault(id(p), (p, s))
    owner = owners(lay, stage_of_unit)
    for _, p in lay.loose:
        if owner[id(p)] in mine:
            found.setdefault(id(p), (p, owner[id(p)]))
    return list(found.values())


def weight_stages(
    lay: ModelUnits, stage_of_unit: Sequence[int]
) -> tuple[dict[int, int], dict[int, frozenset[int]]]:
    """For every loose weight (in no unit, by ``id``): the stage that holds it
    (:func:`owners`); and for every weight, the stages that have it on their rank (those
    whose units use it, and the holder of a loose one). A unit's weight is not lent: a unit
    runs where its stage is, and its weight with it."""
    owner = owners(lay, stage_of_unit)
    users: dict[int, set[int]] = {}
    for unit, s in zip(lay.units, stage_of_unit):
        for p in unit.module.parameters():
            users.setdefault(id(p), set()).add(s)
    holder = {id(p): owner[id(p)] for _, p in lay.loose if id(p) not in users}
    for _, p in lay.loose:
        users.setdefault(id(p), set()).add(owner[id(p)])
    return holder, {k: frozenset(v) for k, v in users.items()}


def keep_only(
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


def tied_groups(
    lay: ModelUnits, stage_of_unit: Sequence[int], ranks: Sequence[int]
) -> list[tuple[int, dist.ProcessGroup, list[nn.Parameter]]]:
    """A process group per set of stages sharing weights that this rank computes one of and
    that spans several ranks (``ranks[s]`` computes stage ``s``; on one rank the stages' uses
    are summed before): the first of those stages (which counts the weights in norms), the
    group and the weights."""
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
        members = sorted({ranks[s] for s in stages})
        if len(members) == 1:
            continue
        if me not in members:
            _count_a_group()
            continue
        # Only the members create it: each replica makes its own groups with its own ranks,
        # which a world-wide new_group (every rank, the same arguments) would not allow.
        group = dist.new_group(members, use_local_synchronization=True, group_desc="pipepar-tied")
        assert isinstance(group, dist.ProcessGroup)
        out.append((stages[0], group, ps))
    return out


def _count_a_group() -> None:
    """Make a group of this rank alone, so that it has made as many groups as the members of
    a group it is not in.

    torch names a group made with ``use_local_synchronization=True`` after its ranks and the
    count of groups the calling rank has made so far, and only the members count the group
    made. Were the other ranks not to count one too, the next group made across members and
    others (a second pipe's, or the user's own) would get a different name on each side, and
    its ranks would wait for each other forever.
    """
    dist.new_group([dist.get_rank()], use_local_synchronization=True, group_desc="pipepar-count")
