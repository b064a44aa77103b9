"""Keep the dp replicas of a stage identical: same initial weights, averaged gradients.

Gradients are averaged while the rank still runs: the runtime calls :meth:`GradientSync.ready`
with a stage's parameters as soon as that stage's last backward action of the mini-batch is
done (their gradients are final then), and each bucket of gradients (a few layers' worth, last
layers first) is all-reduced once all its parameters are ready. A rank that runs several
stages (virtual stages) thus averages its later stage's gradients while its earlier stage still
computes; with one stage per rank the buckets go out when its last action ends, overlapping the
end of the mini-batch (last sends, the loss) only. Buckets are posted strictly in order, so
every replica issues the same collectives in the same order.

Replicas must train on mini-batches of the same shape (the average of their gradients is the
whole batch's gradient only then): stage 0 of every replica all-gathers its input's shape and
dtype when a step starts and compares them before the averaged gradients are written back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipepar.ranks.failure import comm
from pipepar.ranks.mesh import Mesh
from pipepar.ranks.transport import TensorMeta, decode_meta, encode_meta

__all__ = [
    "BUCKET_BYTES",
    "GradientSync",
    "broadcast_from_first",
    "check_replica_inputs",
    "spread_over_replicas",
]

_Shares = TypeVar("_Shares", bound="_Spreadable")


class _Spreadable(Protocol):
    total: float | None

    def spread(
        self: _Shares, globalize: Callable[[float], float] | None, replicas: int
    ) -> _Shares: ...


BUCKET_BYTES = 4 << 20
"""Gradient bytes per all-reduce when a pipe builds its :class:`GradientSync` (read then; every
rank of the grid must see the same value, or the replicas' collectives would not match)."""


def check_replica_inputs(x: object, mesh: Mesh, device: torch.device) -> Callable[[], None]:
    """Post an all-gather of ``x``'s shape over the replicas; return the check to call later.

    The returned callable waits for the gather and raises ``ValueError`` naming the ranks and
    shapes when replicas differ. Nothing is exchanged without replicas or without a tensor
    (the runtime then explains what ``x`` should be).

    Example:
        >>> check = check_replica_inputs(x, pipe.mesh, pipe.device)  # doctest: +SKIP
        >>> run_the_step(); check()  # doctest: +SKIP
    """
    if mesh.dp_group is None or not isinstance(x, Tensor):
        return lambda: None
    try:
        mine = encode_meta([TensorMeta(tuple(x.shape), x.dtype, False)], device)
    except (TypeError, ValueError):  # a dtype or rank the metadata cannot carry: nothing to check
        return lambda: None
    gathered = [torch.empty_like(mine) for _ in range(mesh.dp)]
    what = f"comparing input shapes over ranks {mesh.replica_ranks}"
    with comm(what):
        work = dist.all_gather(gathered, mine, group=mesh.dp_group, async_op=True)

    def check() -> None:
        mesh.progress.wait(work, what)
        _compare_inputs([decode_meta(t)[0] for t in gathered], mesh.replica_ranks)

    return check


def _compare_inputs(metas: list[TensorMeta], ranks: list[int]) -> None:
    if all(m == metas[0] for m in metas):
        return
    holders: dict[TensorMeta, list[int]] = {}
    for rank, meta in zip(ranks, metas, strict=True):
        holders.setdefault(meta, []).append(rank)
    shown = [
        f"{m.shape} {str(m.dtype).removeprefix('torch.')} on rank(s) {who}"
        for m, who in holders.items()
    ]
    raise ValueError(
        f"the replicas got mini-batches of different shapes: x is {' but '.join(shown)}; their "
        "gradients are averaged, so give every replica a mini-batch of the same shape (e.g. "
        "DistributedSampler(..., drop_last=True), or drop the uneven last batch)"
    )


def spread_over_replicas(shares: _Shares, *, mesh: Mesh, device: torch.device) -> _Shares:
    """A replica's loss shares made shares of the batch of every replica together: the rows
    or items they divide by are summed over the replicas (one small all-reduce), and the
    shares scaled so that averaging the replicas' gradients gives the whole batch's.

    Example:
        >>> shares = spread_over_replicas(shares, mesh=mesh, device=device)  # doctest: +SKIP
    """
    if mesh.dp_group is None:
        return shares
    group = mesh.dp_group

    def globalize(count: float) -> float:
        # Once the count is known: at micro-batch 0's loss, when it is learned from the loss's
        # operations; the last stage's ranks of every replica reach it at the same action.
        total = torch.tensor([count], dtype=torch.float64, device=device)
        what = f"summing the loss's items over ranks {mesh.replica_ranks}"
        with comm(what):
            work = dist.all_reduce(total, group=group, async_op=True)
        mesh.progress.wait_watching(work, what)  # a peer replica may fail before its loss
        return float(total.item())

    return shares.spread(globalize, mesh.dp)


def broadcast_from_first(tensors: Iterable[Tensor], mesh: Mesh) -> None:
    """Overwrite ``tensors`` on every replica with replica 0's values (no-op when dp == 1).

    Example:
        >>> broadcast_from_first(pipe.parameters(), pipe.mesh)  # doctest: +SKIP
    """
    if mesh.dp_group is None:
        return
    src = mesh.replica_ranks[0]
    with torch.no_grad():
        _collective(
            list(tensors),
            mesh,
            lambda flat: dist.broadcast(flat, src, group=mesh.dp_group, async_op=True),
            "broadcast of initial weights",
        )


def _collective(
    tensors: list[Tensor], mesh: Mesh, post: Callable[[Tensor], dist.Work | None], what: str
) -> None:
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    flats = [_flatten_dense_tensors(group) for group in buckets.values()]
    with comm(f"{what} over ranks {mesh.replica_ranks}"):
        works = [post(flat) for flat in flats]
    for work, flat, group in zip(works, flats, buckets.values(), strict=True):
        mesh.progress.wait(work, f"{what} over ranks {mesh.replica_ranks}")
        for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.copy_(synced)


class GradientSync:
    """Average a stage's gradients over its dp replicas, overlapped with the backward.

    The runtime calls :meth:`ready` with a stage's parameters once their gradients of the
    mini-batch are final; a bucket is all-reduced as soon as all its parameters are ready (in
    bucket order, the same on every replica), while the rank's other actions still run.

    Args:
        module: the rank's layers (bucketed last to first).
        mesh: this rank's grid position; nothing happens without a dp group.
        bucket_bytes: gradients per all-reduce, at least one parameter's (default
            :data:`BUCKET_BYTES`).

    Example:
        >>> sync = GradientSync(stage, mesh)  # doctest: +SKIP
        >>> sync.arm(); sync.ready(params); sync.finish()  # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, mesh: Mesh, *, bucket_bytes: int | None = None) -> None:
        self.mesh = mesh
        size = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets = _buckets(module, size) if mesh.dp_group is not None else []
        self._bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self._missing: list[int] = []
        self._posted: list[tuple[dist.Work | None, str, Callable[[], None]]] = []
        self._armed = False
        self.posted_early = 0
        """Buckets of the last mini-batch posted while the rank still had actions to run (their
        all-reduce overlapped computation)."""
        self.posted_before_finish = 0
        """Buckets of the last mini-batch posted by :meth:`ready`, before :meth:`finish`."""

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The weights whole for the actions of one mini-batch: here they always are (each
        replica holds them all); :class:`~pipepar.ranks.sharding.ShardedSync` gathers its
        shards."""
        yield

    def arm(self) -> None:
        """A mini-batch starts: post each bucket once all its gradients are ready."""
        self._missing = [len(bucket) for bucket in self.buckets]
        self._posted = []
        self._armed = True
        self.posted_early = 0
        self.posted_before_finish = 0

    def ready(self, params: Iterable[Tensor], overlapped: bool = True) -> None:
        """These parameters' gradients are final for the mini-batch (in ``.grad``).

        Args:
            params: parameters of one stage.
            overlapped: whether the rank still has actions to run, so the all-reduces posted
                now overlap them (counted in :attr:`posted_early`).
        """
        if not self._armed:
            return
        for p in params:
            k = self._bucket_of.get(id(p))
            if k is not None:
                self._missing[k] -= 1
        while len(self._posted) < len(self.buckets) and self._missing[len(self._posted)] == 0:
            self._post(len(self._posted))
            self.posted_early += int(overlapped)

    def finish(self, extra: Tensor | None = None) -> None:
        """Post the buckets left, average ``extra`` too, wait and write the means back."""
        self._armed = False
        if self.mesh.dp_group is None:
            return
        self.posted_before_finish = len(self._posted)
        while len(self._posted) < len(self.buckets):
            self._post(len(self._posted))
        if extra is not None:
            self._post_tensors([extra])
        with torch.no_grad():
            for work, what, land in self._posted:
                self.mesh.progress.wait(work, what)
                land()
        self._posted = []

    def drop(self) -> None:
        """Forget the posted all-reduces without waiting (after a failure: their works would
        keep the dp group's connections open)."""
        self._armed = False
        self._posted = []

    def _post(self, k: int) -> None:
        self._post_tensors([p.grad for p in self.buckets[k] if p.grad is not None])

    def _post_tensors(self, tensors: list[Tensor]) -> None:
        """All-reduce ``tensors`` (flattened); once done, their replicas' mean lands in them."""
        flat = _flatten_dense_tensors(tensors) if tensors else torch.zeros(0)
        what = f"gradient all-reduce over ranks {self.mesh.replica_ranks}"
        self.mesh.progress.check_failures()  # a replica that left would not end this one
        with comm(what):
            work = dist.all_reduce(flat, group=self.mesh.dp_group, async_op=True)

        def land() -> None:
            flat.div_(self.mesh.dp)
            for t, mean in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(mean)

        self._posted.append((work, what, land))


def _buckets(module: nn.Module, bucket_bytes: int) -> list[list[Tensor]]:
    """Trainable parameters grouped by dtype and device, last layer first, ~bucket_bytes each."""
    buckets: list[list[Tensor]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    seen: set[int] = set()
    for layer in reversed(list(module.children())):
        for p in reversed(list(layer.parameters())):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            bucket = open_.setdefault((p.dtype, p.device), [])
            bucket.append(p)
            if sum(t.numel() * t.element_size() for t in bucket) >= bucket_bytes:
                buckets.append(open_.pop((p.dtype, p.device)))
    return buckets + [b for b in open_.values() if b]
