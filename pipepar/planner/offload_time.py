"""What activation offload adds to a predicted step: the copies to host memory and back, where
they do not run beside compute.

A micro-batch that the offload plan sends out (:mod:`pipepar.core.offload_plan`) on stage
``s`` moves what its forward saves beyond the stage's input and output (the bytes
:class:`~pipepar.planner.stage_memory.MemoryModel` with ``offload=True`` stops counting while
it is away) twice: out during its ``F``, and back during the action the plan brings it back
with (the one ``lead`` places before its ``B``). A checkpointed micro-batch saves nothing and
moves nothing.

- **A device with a host link** (:attr:`~pipepar.planner.cluster.Cluster.host`, a GPU's
  PCIe): each copy takes ``host.seconds(bytes)`` on a side stream, beside the action it runs
  with. Only what it takes beyond that action's own time costs the step: the copy out's
  excess is added to the ``F`` (its tensors leave as it ends), the copy back's to the
  micro-batch's ``B`` (which waits for its tensors).
- **A device that is the host** (the CPU, ``host=None``): a copy is a ``memcpy`` on the
  worker, reading and writing each byte at the cluster's ``memory_bandwidth``: ``2 * bytes /
  memory_bandwidth`` added to the ``F`` (out) and to the action bringing it back.

Not counted: a link shared by copies going both ways or by several devices, the copy
engines' set-up, the pinned host memory's allocation (done once, then reused).

    >>> extra = offload_ms(order, prof, checkpoint="never", cost=cost, cluster=cluster)
    >>> sum(extra.values())  # ms the step's actions take longer
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipepar.core.offload_plan import OffloadPlan, plan_offload
from pipepar.core.recompute import should_checkpoint
from pipepar.core.schedule import Action, Schedule
from pipepar.planner.cluster import Cluster
from pipepar.planner.profile import Profile
from pipepar.planner.stage_memory import MemoryModel

__all__ = ["offload_ms", "sent_bytes"]


def sent_bytes(
    profile: Profile, order: Schedule, stages: Sequence[range], checkpoint: str
) -> list[int]:
    """Per stage, the bytes one micro-batch sent out moves each way: what its forward saves
    beyond the stage's input and output, as the memory model counts it."""
    memory = MemoryModel(profile, order, checkpoint=checkpoint, foreach=[False] * order.n_workers)
    out = []
    for span in stages:
        figures = memory.figures(span.start, span.stop - 1)
        out.append(max(0, figures.whole - figures.away))
    return out


def offload_ms(
    order: Schedule,
    sent: Sequence[int],
    *,
    checkpoint: str,
    cost: Callable[[Action], float],
    cluster: Cluster,
    plan: OffloadPlan | None = None,
) -> dict[Action, float]:
    """Per action, the milliseconds offload adds to it (see the module's docstring).

    Args:
        order: the schedule.
        sent: per stage, the bytes a micro-batch sent out moves each way (:func:`sent_bytes`).
        checkpoint: the recompute policy (checkpointed micro-batches move nothing).
        cost: each action's own time (ms), which a copy beside it hides.
        cluster: the machines: their host link, or their memory bandwidth.
        plan: what is sent out and brought back (default: :func:`plan_offload` of ``order``).
    """
    plan = plan_offload(order) if plan is None else plan
    back = {
        key: a
        for actions in order.actions
        for a in actions
        for key in plan.reloads.get((a.stage, a.kind, a.microbatch), ())
    }
    extra: dict[Action, float] = {}
    for s, i in sorted(plan.sent):
        if should_checkpoint(checkpoint, i, order.n_microbatches) or sent[s] <= 0:
            continue
        forward, reload = Action(s, "F", i), back[(s, i)]
        if cluster.host is None:  # a memcpy on the worker, both ways
            copy = 2e3 * sent[s] / (cluster.memory_bandwidth or cluster.intra.bandwidth)
            _add(extra, forward, copy)
            _add(extra, reload, copy)
        else:  # beside the action, on the copy stream
            copy = 1e3 * cluster.host.seconds(sent[s])
            _add(extra, forward, max(0.0, copy - cost(forward)))
            _add(extra, Action(s, "B", i), max(0.0, copy - cost(reload)))
    return extra


def _add(extra: dict[Action, float], a: Action, ms: float) -> None:
    if ms > 0:
        extra[a] = extra.get(a, 0.0) + ms
