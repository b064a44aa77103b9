"""``recompute="bubbles"`` across ranks places the recomputes on the stages' measured times
from the second training step on: the ranks share their times once, every rank places the same
schedule on them (a differing one is refused on every rank), and every step keeps the plain
model's numbers; an ``nn.Sequential``'s chain and a model cut while it runs (whose forward
actions wait for messages: timed without those waits)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

from tests._ranks import spawn

pytestmark = pytest.mark.slow

ROWS = (8, 8, 8, 3, 8)
"""Rows per step: the third step on runs on measured times, the fourth's 3 micro-batches too
(placed on them for that count), then chunks' again."""


class _Nap(nn.Module):
    """Identity that takes 20 ms: stage 0 much slower than the others, whatever the load."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), _Nap()]
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers)


def _moved(schedule: Any) -> int:
    """R listed anywhere but just before their own B."""
    from pipepar.core.schedule import Action

    pairs = [p for w in schedule.actions for p in zip(w, (*w[1:], None))]
    return sum(1 for a, b in pairs if a.kind == "R" and b != Action(a.stage, "B", a.microbatch))


def _spy_on_sharing() -> list[dict[tuple[int, str], float]]:
    """The times each sharing of this rank's pipe gave, in order."""
    from pipepar.ranks.shared_times import SharedTimes

    shared: list[dict[tuple[int, str], float]] = []
    share = SharedTimes.share

    def spy(self: SharedTimes, *args: Any) -> Any:
        cost = share(self, *args)
        shared.append(dict(self.means))
        return cost

    SharedTimes.share = spy  # type: ignore[method-assign]
    return shared


def _training(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    model = _model()
    plain = copy.deepcopy(model)
    pipe = ppd.wrap(model, [2, 2, 2, 2], chunks=4, schedule="zb-v", checkpoint="always",
                    recompute="bubbles")  # fmt: skip

    def losses(step: int, rows: int) -> tuple[float, torch.Tensor]:
        torch.manual_seed(100 + step)
        x, y = torch.randn(rows, 8), torch.randn(rows, 8)
        loss = pipe.step(x if pipe.stage_index == 0 else None, y, nn.functional.mse_loss)
        return loss, nn.functional.mse_loss(plain(x), y)

    return _trained(pipe, plain, losses)


def _trained(pipe: Any, plain: nn.Module, losses: Any) -> dict[str, Any]:
    """Train ``pipe`` (a zb-v over 4 stages, 4 chunks, recomputing in the bubbles) and
    ``plain`` side by side over :data:`ROWS` (``losses(step, rows)``: the pipe's loss and the
    plain model's); what the sharing gave, where the schedule's R went, every step's largest
    gap to the plain model."""
    from pipepar.core.action_times import cost_of
    from pipepar.core.named_schedules import make
    from pipepar.core.recompute_placement import checkpointed, place_recomputes, placed_for

    shared = _spy_on_sharing()
    base = make("zb-v", 4, 4, n_workers=2)
    unit = placed_for(base, "bubbles", "always")
    out: dict[str, Any] = {"unit before": pipe.schedule == unit, "moved before": _moved(unit)}
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, plain))
    gaps = []
    for step, rows in enumerate(ROWS):
        loss, expected = losses(step, rows)
        expected.backward()
        own = dict(plain.named_parameters())
        gap = abs(loss - float(expected.detach()))
        for name, p in pipe.named_parameters():
            gap = max(gap, float((p.grad - own[name].grad).abs().max()))
        gaps.append(gap)
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
        if step < 2:  # the first step warms up, the second is timed
            out[f"shared after step {step}"] = len(shared)
            out[f"unit after step {step}"] = pipe.schedule == unit
    out["gaps"], out["times"], out["sharings"] = gaps, shared[:1], len(shared)
    for times in shared[:1]:
        measured = place_recomputes(base, checkpointed(base, "always"), cost=cost_of(times))
        out["measured"] = pipe.schedule == measured
    out["unit after"] = pipe.schedule == unit
    out["moved after"] = _moved(pipe.schedule)
    out["schedule"] = [[repr(a) for a in work] for work in pipe.schedule.actions]
    pipe.close()
    return out


def _placed_on_shared_times(results: dict[int, dict[str, Any]]) -> dict[tuple[int, str], float]:
    """Check what both tests of a pipe placed on measured times check; the times shared."""
    for out in results.values():
        assert out["unit before"] and out["moved before"] == 0  # unit costs move no R here
        assert out["unit after step 0"]  # the second step runs it too, and times the stages
        # The third step on: placed on measured times (stage 0 is slow, and its rank's other
        # stage, 3, idles before each F, where R now run), not what unit costs give.
        assert not out["unit after step 1"] and not out["unit after"] and out["moved after"] > 0
        assert out["shared after step 0"] == 0 and out["shared after step 1"] == 1
        assert out["sharings"] == 1  # shared once, not every step
        assert out["measured"]  # placed on exactly the times shared
        assert max(out["gaps"]) < 1e-5, out["gaps"]  # every step, before and after the switch
    first, second = results[0]["times"][0], results[1]["times"][0]
    assert first == second  # the same numbers, bit for bit
    assert {s for s, _ in first} == {0, 1, 2, 3}  # each rank's own stages, joined
    assert results[0]["schedule"] == results[1]["schedule"]
    return first


def test_after_the_first_step_every_rank_places_on_the_shared_measured_times() -> None:
    times = _placed_on_shared_times(spawn(2, _training))
    assert times[0, "F"] > 5 * times[1, "F"]  # stage 0 naps


def _check(rank: int) -> dict[str, Any]:
    """The schedule check and the sharing over the replicas (one stage, two replicas)."""
    from pipepar.core.named_schedules import gpipe, one_f_one_b
    from pipepar.ranks.mesh import build_mesh
    from pipepar.ranks.shared_times import SharedTimes, check_same_schedule

    mesh = build_mesh(1, 2, group=None, timeout=None)  # the two ranks are replicas
    device = torch.device("cpu")
    out: dict[str, Any] = {}
    check_same_schedule(one_f_one_b(2, 4), mesh, device)  # the same: passes
    try:
        check_same_schedule(one_f_one_b(2, 4) if rank == 0 else gpipe(2, 4), mesh, device)
        out["differ"] = "no error"
    except RuntimeError as error:
        out["differ"] = str(error)
    times = SharedTimes(2, [0, 1], warmup=0)
    record = times.recorder()
    assert record is not None
    for stage in (0, 1):  # replica 1 is slower on stage 0, replica 0 on stage 1
        slow = 3.0 if stage == rank else 1.0
        record(stage, 0, "forward", 0.0, slow)
        record(stage, 0, "backward", 0.0, 2 * slow)
    out["cost"] = times.due() and times.share(mesh, device) is not None
    out["times"] = times.means
    lacking = SharedTimes(2, [0, 1], warmup=0)  # stage 1 never ran a backward on either replica
    record = lacking.recorder()
    assert record is not None
    for stage in (0, 1):
        record(stage, 0, "forward", 0.0, 1.0)
    record(0, 0, "backward", 0.0, 1.0)
    out["lacking"] = lacking.share(mesh, device)
    mesh.close()
    return out


def test_the_replicas_share_the_slowest_times_and_a_differing_schedule_is_refused() -> None:
    results = spawn(2, _check)
    for out in results.values():
        assert "placed their recomputes into different schedules" in out["differ"]
        assert out["cost"] and out["lacking"] is None  # incomplete times: unit costs stay
        assert out["times"] == {(0, "F"): 3.0, (0, "B"): 6.0, (1, "F"): 3.0, (1, "B"): 6.0}


def _nano_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of a step."""
    g = torch.Generator().manual_seed(100 + step)
    ids, targets = (torch.randint(0, 11, (rows, 6), generator=g) for _ in range(2))
    return ids, targets


def _nap(*args: Any) -> None:
    time.sleep(0.1)  # stage 0's forward (and its recompute) 100 ms longer, whatever the load


def _cut_training(rank: int) -> dict[str, Any]:
    """A nanoGPT cut while it runs (any model's path across ranks), stage 0 napping."""
    import pipepar.distributed as ppd
    from tests._foreign_models import NanoGPT

    torch.manual_seed(0)
    plain = NanoGPT(layers=4)
    model = copy.deepcopy(plain)
    model.h[0].fc.register_forward_pre_hook(_nap)
    pipe = ppd.wrap(model, split=["h.1", "h.2", "h.3"], chunks=4, schedule="zb-v",
                    checkpoint="always", recompute="bubbles")  # fmt: skip

    def losses(step: int, rows: int) -> tuple[float, torch.Tensor]:
        idx, targets = _nano_batch(step, rows)
        return pipe.step(idx, targets), plain(idx, targets)[1]  # the model's own loss

    return _trained(pipe, plain, losses)


def test_a_model_cut_while_it_runs_places_on_its_stages_own_times_without_waits() -> None:
    """The cut model's forward receives its stage's inputs inside F (and B its gradients):
    each action is timed without the link's waits, so a stage waiting on a slow peer does not
    look slow itself, and every rank places the same schedule on the shared times."""
    times = _placed_on_shared_times(spawn(2, _cut_training))
    # Stage 1's forward waits ~100 ms for stage 0's activations on every micro-batch (timed
    # with that wait, it came out as long as stage 0's own); without it, a fraction of it.
    assert times[0, "F"] > 3 * times[1, "F"], times
