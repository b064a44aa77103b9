"""Sharded data parallelism at one pipeline position: the stage's parameters, gradients and
optimizer state split over its dp replicas with torch's FSDP2 (``fully_shard``).

Between steps each replica holds a shard of every local parameter (a ``DTensor`` sharded on
dimension 0 over the position's dp group, as FSDP2 lays it out), so ``pipe.parameters()`` are
the shards and an optimizer built over them keeps shard-sized state. Within a step:

* **Gather once.** :meth:`ShardedSync.gathered` all-gathers the rank's weights (FSDP's
  ``unshard``) before the rank's first action and frees them (``reshard``) after its last:
  every micro-batch of every schedule (a rank's virtual stages too) runs on the same gathered
  weights, never gathered per micro-batch.
* **Reduce-scatter once.** pipepar sums each parameter's gradient over the micro-batches
  itself (:mod:`pipepar.core.step`); those sums are reduce-scattered over the replicas, bucket
  by bucket as the stage's last backward makes them (the buckets and their order of
  :class:`~pipepar.ranks.replicas.GradientSync`), and each replica's share of the mean lands
  in the shard's ``.grad``, a ``DTensor`` like the parameter (added to it: gradients
  accumulate across steps until ``zero_grad()``).

FSDP's own forward and backward hooks never fire: ``fully_shard`` is applied to a holder
module that owns the rank's layers but is never called (the stages call the layers). Its
hooks would gather and reshard per module call and reduce-scatter per backward pass, which
is per micro-batch here, and would queue callbacks into every ``autograd.grad`` the steps run.
Weights are gathered whole on the rank for the step; what shards is the memory held between
steps (parameters, gradients, optimizer state), as with ZeRO-3 and a gather kept for the step.

**Any model** (:mod:`pipepar.program.rank_compute`) tracks its weights by object identity (which
stage holds which, weights tied across stages, the stand-ins its cut swaps in), which FSDP's
swap of the modules' parameters would break. :meth:`ShardedSync.of_parameters` keeps the
model's parameter objects where they are: ``fully_shard`` shards a holder of *copies*, and
for a step each model parameter's ``.data`` is the gathered weight (an empty placeholder of
the same shape between steps, no storage); the gradients the pipe writes into the model
parameters' ``.grad`` are reduce-scattered into the shards as above.

Not supported (yet): FSDP's mixed precision and CPU offload policies, 0-dim parameters (they
cannot be cut on dimension 0).

This module knows nothing of schedules or transport: the pipe says when a step runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.replicas import GradientSync

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "ShardedSync",
    "check_dp_shard",
    "full_tensors",
    "is_dtensor",
    "shard_like",
    "shard_state",
]

T = TypeVar("T")


def check_dp_shard(dp_shard: object, dp: int) -> bool:
    """``dp_shard`` if it is a bool that ``dp`` replicas can honour.

    Example:
        >>> check_dp_shard(True, 2)
        True
    """
    if not isinstance(dp_shard, bool):
        raise TypeError(f"dp_shard must be True or False, but got {dp_shard!r}")
    if dp_shard and dp < 2:
        raise ValueError(
            f"dp_shard=True shards each stage over its dp replicas, but dp={dp}; pass dp=2 or "
            "more (the group then needs pp * dp ranks), or dp_shard=False"
        )
    return dp_shard


class _Holder(nn.Module):
    """Owns a rank's layers for ``fully_shard``; never called (see the module docstring)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("the shard holder is never called: the pipe's stages run the layers")


class _Weight(nn.Module):
    """A copy of one model parameter for the holder of :meth:`ShardedSync.of_parameters`."""

    def __init__(self, p: nn.Parameter) -> None:
        super().__init__()
        self.weight = nn.Parameter(p.detach(), requires_grad=p.requires_grad)


class ShardedSync(GradientSync):
    """The rank's layers sharded over their dp replicas; gradients reduce-scattered into the
    shards once per step. Used like :class:`~pipepar.ranks.replicas.GradientSync` (``arm``,
    ``ready``, ``finish``), with every step's actions run inside :meth:`gathered`.

    Args:
        layers: the rank's layers (all its stages'), in model order; their parameters become
            ``DTensor`` shards in place (the modules keep them under the same names).
        mesh: this rank's grid position (the shards span its dp group).
        device: where the rank computes.
        bucket_bytes: gradient bytes (whole, before the scatter) per reduce-scatter.

    Example:
        >>> sync = ShardedSync(layers, mesh, torch.device("cpu"))  # doctest: +SKIP
        >>> with sync.gathered():  # doctest: +SKIP
        ...     sync.arm(); run_the_step(); sync.finish()
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        mesh: Mesh,
        device: torch.device,
        *,
        bucket_bytes: int | None = None,
    ) -> None:
        if mesh.dp_group is None:
            raise ValueError("sharding needs dp replicas (dp >= 2) to shard over")
        holder = _Holder(layers)
        _check_parameters((n.removeprefix("layers."), p) for n, p in holder.named_parameters())
        # FSDP2 and DTensor load here, with the first sharded pipe (about 2 s of CPU): a
        # process that shards nothing never imports them.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # DeviceMeshes of the same ranks compare equal whatever their group, and DTensor's
        # caches keep the first one seen: a name of this group keeps a later pipe's apart.
        group = DeviceMesh.from_group(
            mesh.dp_group, device.type, mesh_dim_names=(f"dp-{mesh.dp_group.group_name}",)
        )
        fully_shard(holder, mesh=group, reshard_after_forward=True)
        assert isinstance(holder, FSDPModule)  # fully_shard changed its class in place
        self._holder = holder  # not a child of the pipe: its keys stay the model's
        super().__init__(holder.layers, mesh, bucket_bytes=bucket_bytes)
        self._names = {id(p): name for name, p in holder.named_parameters()}
        self._whole: dict[int, nn.Parameter] = {}
        """Shard id -> the gathered parameter that stands in for it during a step."""
        self._kept: dict[str, tuple[nn.Parameter, Tensor]] = {}
        """Holder name -> the model parameter that keeps its place (:meth:`of_parameters`)
        and its empty placeholder between steps."""
        self.shards: list[nn.Parameter] = []
        """The shards of the parameters given to :meth:`of_parameters`, in their order."""

    @classmethod
    def of_parameters(
        cls,
        named: Sequence[tuple[str, nn.Parameter]],
        mesh: Mesh,
        device: torch.device,
        *,
        bucket_bytes: int | None = None,
    ) -> ShardedSync:
        """Shard the parameters ``named`` (each once) while the modules that use them keep
        them: their shards are :attr:`shards`; in :meth:`gathered` each parameter's ``.data``
        is its gathered weight, between steps an empty placeholder (its memory is the
        shard's); gradients put into their ``.grad`` during the step (then :meth:`ready` with
        them, :meth:`finish`) land in the shards' ``.grad``.

        Example:
            >>> named = list(model.named_parameters())  # doctest: +SKIP
            >>> sync = ShardedSync.of_parameters(named, mesh, dev)  # doctest: +SKIP
            >>> opt = torch.optim.AdamW(sync.shards)  # doctest: +SKIP
        """
        _check_parameters(named)
        sync = cls([_Weight(p) for _, p in named], mesh, device, bucket_bytes=bucket_bytes)
        shards = dict(sync._holder.named_parameters())
        for k, (_, p) in enumerate(named):
            key = f"layers.{k}.weight"
            sync._kept[key] = (p, _empty_like(p))
            sync.shards.append(shards[key])
            p.data = sync._kept[key][1]  # the whole weight is freed: the shard holds it
        return sync

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Gather the rank's weights for one step; free them (and their whole gradients)
        after, also when the step fails."""
        what = f"gathering the weights' shards over ranks {self.mesh.replica_ranks}"
        self.mesh.progress.begin("gathering the weights' shards")
        self.mesh.progress.check_failures()
        try:
            with comm(what):
                self.mesh.progress.waiting = what  # a stall ends at the dp group's timeout
                self._holder.unshard()
                self.mesh.progress.waiting = None
            whole = dict(self._holder.named_parameters())
            for name, (p, _) in self._kept.items():  # the model's own parameter computes
                p.data = whole[name].data
                whole[name] = p
            self._whole = {id(p): whole[self._names[id(p)]] for b in self.buckets for p in b}
            self._bucket_of = {
                id(self._whole[id(p)]): k for k, bucket in enumerate(self.buckets) for p in bucket
            }
            yield
        finally:
            for p in self._whole.values():
                p.grad = None
            self._whole = {}
            self._holder.reshard()
            for p, empty in self._kept.values():
                p.data = empty

    def _post(self, k: int) -> None:
        """Reduce-scatter bucket ``k``'s whole gradients (dropped once packed); the mean's
        shards land in ``.grad``."""
        whole = [self._whole[id(p)] for p in self.buckets[k]]
        pairs = [(p, w.grad) for p, w in zip(self.buckets[k], whole) if w.grad is not None]
        if not pairs:  # nothing to reduce: the replicas still match collective for collective
            self._post_tensors([])
            return
        chunks = self.mesh.dp
        widths = [_rows(g.shape[0], chunks) * g.shape[1:].numel() for _, g in pairs]
        send = pairs[0][1].new_zeros(chunks, sum(widths))
        offsets = [sum(widths[:j]) for j in range(len(widths))]
        for (_, g), offset, width in zip(pairs, offsets, widths, strict=True):
            _pad_into(send[:, offset : offset + width], g, chunks)
        for w in whole:
            w.grad = None
        mine = send.new_empty(sum(widths))
        what = f"gradient reduce-scatter over ranks {self.mesh.replica_ranks}"
        self.mesh.progress.check_failures()  # a replica that left would not end this one
        with comm(what):
            work = dist.reduce_scatter_single(
                mine, send.view(-1), group=self.mesh.dp_group, async_op=True
            )
        params = [(p, g.shape) for p, g in pairs]
        land = functools.partial(self._land, params, mine, offsets, send)
        self._posted.append((work, what, land))

    def _land(
        self,
        params: list[tuple[Tensor, torch.Size]],
        mine: Tensor,
        offsets: list[int],
        send: Tensor,
    ) -> None:
        """Add this replica's rows of the mean (``mine``, the reduce-scatter's output) into the
        shards' ``.grad``; ``send``, its input, is only kept alive until the collective ends."""
        chunks, rank = self.mesh.dp, dist.get_rank(self.mesh.dp_group)
        mine.div_(chunks)
        for (p, shape), offset in zip(params, offsets, strict=True):
            rows = _rows(shape[0], chunks)
            local = mine[offset : offset + rows * shape[1:].numel()].view(rows, *shape[1:])
            _add_shard(p, local[: _local_rows(shape[0], rows, rank)])


def _check_parameters(named: Iterable[tuple[str, Tensor]]) -> None:
    """Refuse what FSDP2 cannot shard on dimension 0, naming the parameter."""
    for name, p in named:
        if p.dim() == 0:
            raise ValueError(
                f"parameter {name!r} is a 0-dim tensor, which cannot be sharded on dimension "
                "0; make it shape (1,) or pass dp_shard=False"
            )


def _empty_like(p: Tensor) -> Tensor:
    """A tensor shaped like ``p`` on its device with no storage: a parameter's ``.data``
    between steps, when its weight lives in its shard."""
    empty = torch.empty_like(p.detach(), memory_format=torch.contiguous_format)
    empty.untyped_storage().resize_(0)
    return empty


def _rows(total: int, chunks: int) -> int:
    """Rows of dimension 0 per shard (FSDP2 pads every shard to the first one's)."""
    return -(-total // chunks)


def _local_rows(total: int, rows: int, rank: int) -> int:
    """Rows of shard ``rank`` (``torch.chunk``'s split: the last shards may be short or empty)."""
    return max(0, min(rows, total - rank * rows))


def _pad_into(send: Tensor, g: Tensor, chunks: int) -> None:
    """Copy ``g`` into ``send`` (chunks x padded shard), shard ``j`` into row ``j``; the
    padding (short or empty last shards) is left as it is: zeros, as the caller makes it."""
    rows = _rows(g.shape[0], chunks)
    by_row = send.view(chunks, rows, -1)
    flat = g.reshape(g.shape[0], -1)
    for j in range(chunks):
        n = _local_rows(g.shape[0], rows, j)
        by_row[j, :n].copy_(flat[j * rows : j * rows + n])


def _add_shard(p: Tensor, local: Tensor) -> None:
    """Add ``local`` (this replica's rows of the mean gradient) into shard ``p``'s ``.grad``."""
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)  # fully_shard made every parameter one
    if p.grad is None:
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    else:
        p.grad.to_local().add_(local)  # type: ignore[attr-defined]


def full_tensors(value: T) -> T:
    """``value`` (a tensor, or a dict of them, nested) with every ``DTensor`` gathered whole:
    a collective over its replicas, so call it on all of them with the same keys in the same
    order. Other values come back as they are.

    Example:
        >>> full_tensors({"w": torch.ones(2), "step": 3})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    if is_dtensor(value):
        return value.full_tensor()  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return {k: full_tensors(v) for k, v in value.items()}  # type: ignore[return-value]
    return value


def shard_state(saved: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Any]:
    """Named optimizer state (:mod:`pipepar.persist.named_state`) of whole tensors made this
    replica's shards, for the parameters of ``params`` that are ``DTensor`` shards: each state
    tensor shaped like its parameter (``exp_avg`` ...) is cut like it; others (``step``) stay.

    Example:
        >>> shard_state({"state": {"w": {"step": 1}}, "param_groups": []}, {})["state"]
        {'w': {'step': 1}}
    """
    state = {}
    for name, entry in saved["state"].items():
        p = params.get(name)
        state[name] = {
            k: shard_like(v, p)
            if p is not None and isinstance(v, Tensor) and v.shape == p.shape
            else v
            for k, v in entry.items()
        }
    return {**saved, "state": state}


def shard_like(value: Tensor, like: Tensor) -> Tensor:
    """``value``, a whole tensor, as this replica's shard laid out like ``like`` (a ``DTensor``;
    no communication); ``value`` itself when ``like`` is a plain tensor or it is one already.

    Example:
        >>> shard_like(torch.ones(2), torch.zeros(2))
        tensor([1., 1.])
    """
    if not is_dtensor(like) or is_dtensor(value):
        return value
    from torch.distributed.tensor import Replicate
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"a tensor of shape {tuple(value.shape)} cannot load into a parameter of shape "
            f"{tuple(like.shape)}; load a state_dict of the same model"
        )
    whole = type(like).from_local(
        value.to(like.device), like.device_mesh, [Replicate()], run_check=False
    )
    return whole.redistribute(like.device_mesh, like.placements)


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a ``DTensor``; without importing DTensor's module when no code
    has (then none can exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
