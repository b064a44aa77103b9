"""Real models under ``pipepar.distributed`` with the virtual-stage schedules: four stages on
two gloo ranks (``"interleaved-1f1b"``: stages 0 and 2 on rank 0; ``"zb-v"``, ``"v-half"`` and
``"v-min"``: stages 0 and 3, so GPT-2's tied embedding and head on one rank, and 1 and 2,
handed over on rank 1), and a pp=2 x dp=2 grid on four. Over three steps (the first learns
the route, the others follow it) the loss and every gradient equal the plain model's."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("timm")

from models import transformers_zoo as zoo
from tests._ranks import spawn
from tests.program._real import Skipping, mode_calls

pytestmark = pytest.mark.slow
RTOL = 1e-5
VIRTUAL = ["interleaved-1f1b", "zb-v"]
SPLITS = {  # four stages of the zoo's four-block models
    "gpt2": ["transformer.h.1", "transformer.h.2", "transformer.h.3"],
    "llama": ["model.layers.1", "model.layers.2", "model.layers.3"],
    "bert": ["bert.encoder.layer.1", "bert.encoder.layer.2", "bert.encoder.layer.3"],
    "vit_timm": ["blocks.1", "blocks.2", "blocks.3"],
    "vit_torchvision": [f"encoder.layers.encoder_layer_{k}" for k in (1, 2, 3)],
}
CASES = [
    ("gpt2", "interleaved-1f1b"),
    ("gpt2", "zb-v"),
    ("llama", "zb-v"),
    ("bert", "interleaved-1f1b"),
    ("vit_timm", "zb-v"),
    ("vit_torchvision", "interleaved-1f1b"),
    ("gpt2", "v-min"),
    ("llama", "v-half"),
]
"""GPT-2 under both schedules, each other model under one (every model x every schedule x
every checkpoint mode is test_ranks_every_feature's)."""
STAGES = {
    "interleaved-1f1b": [[0, 2], [1, 3]],
    "zb-v": [[0, 3], [1, 2]],
    "v-half": [[0, 3], [1, 2]],
    "v-min": [[0, 3], [1, 2]],
}
"""The stages of each rank."""


def _loss_fn(name: str) -> Any:
    if name.startswith("vit"):
        return lambda out, _: out.float().logsumexp(-1).mean()
    return None


def _batch(name: str, step: int, *, batch: int = 4) -> dict[str, Any]:
    if name.startswith("vit"):
        return zoo.sample(name, batch=batch, seed=step % 2)
    return zoo.padded_sample(name, batch=batch, seq=8, seed=step % 2)


def _counting_mode_calls(run: Callable[[int], Any]) -> list[tuple[int, Any]]:
    """``run(step)`` for three steps, each with the count of operations that passed the cut's
    mode."""
    out = []
    for step in range(3):
        with mode_calls() as count:
            got = run(step)
        out.append((count[0], got))
    return out


def _following(
    name: str,
    schedule: str,
    *,
    dp: int = 1,
    checkpoint: str = "never",
    dropout: float = 0.0,
    split: list[str] | None = None,
) -> dict[str, Any]:
    """Three steps of the same kind on this rank's stages: the count of operations that passed
    the cut's mode, the loss and the gradients of each step; then an evaluation (``pipe(...)``
    under no_grad)."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build(name, dropout=dropout)
    pipe = ppd.wrap(
        model,
        split=split or SPLITS[name],
        chunks=2,
        schedule=schedule,
        dp=dp,
        checkpoint=checkpoint,
    )
    replica = pipe.mesh.where.replica

    def step(number: int) -> tuple[float, dict[str, Any]]:
        whole = _batch(name, number, batch=4 * dp)
        batch = {k: v.chunk(dp)[replica] for k, v in whole.items()}  # this replica's rows
        loss = pipe.step(**batch, loss_fn=_loss_fn(name))
        grads = {n: p.grad.numpy().copy() for n, p in pipe.named_parameters()}
        pipe.zero_grad()
        return loss, grads

    with _counting_messages() as messages, _counting_stand_ins() as stand_ins:
        steps = _counting_mode_calls(step)
    with torch.no_grad():
        out = pipe(**_batch(name, 0))
    pipe.close()
    output = None if out is None else (out if name.startswith("vit") else out.logits).numpy()
    return {
        "stages": pipe.stages,
        "steps": steps,
        "output": output,
        "messages": messages,
        "stand_ins": stand_ins[0],
    }


@contextlib.contextmanager
def _counting_messages() -> Iterator[Counter[tuple[int, int]]]:
    """Count the activation messages this rank sends, by (producer, consumer) stage."""
    from pipepar.program.rank_messages import ACTIVATION, RankMessages

    counts: Counter[tuple[int, int]] = Counter()
    send = RankMessages._send

    def counted(self: RankMessages, buffer: Any, value: str, kind: int, *stages: int) -> None:
        if kind == ACTIVATION:
            counts[stages] += 1
        send(self, buffer, value, kind, *stages)

    RankMessages._send = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        RankMessages._send = send  # type: ignore[method-assign]


@contextlib.contextmanager
def _counting_stand_ins() -> Iterator[list[int]]:
    """Count the stand-ins on ``meta`` made for the arguments of other ranks' unit calls while
    a route is followed."""
    from pipepar.program.ranks import RankCut

    count = [0]
    enter = RankCut._enter

    def counted(self: RankCut, t: Any, producer: int, stage: int) -> Any:
        if stage not in self.mine and self.following:
            count[0] += 1
        return enter(self, t, producer, stage)

    RankCut._enter = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        RankCut._enter = enter  # type: ignore[method-assign]


def _skipping(schedule: str, routes: bool) -> list[float] | str:
    """Four stages of ``Skipping``: with routes, a step that leaves the route ends every rank
    with the cause; without, every path is right."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    split = ["blocks.1", "blocks.2", "blocks.3"]
    pipe = ppd.wrap(Skipping(), split=split, chunks=2, schedule=schedule, routes=routes, timeout=30)
    x = torch.rand(4, 4)
    losses = []
    try:
        for k in (0, 0, 1, 0):
            skip = torch.full((4,), k)
            losses.append(pipe.step(x, skip, loss_fn=lambda out, t: out.square().mean()))
    except ppd.PipelineError as error:
        return str(error)
    finally:
        pipe.close()
    return losses


def _two_ranks(rank: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {(name, schedule): _following(name, schedule) for name, schedule in CASES}
    for schedule in VIRTUAL:
        out[("path_change", schedule)] = _skipping(schedule, routes=True)
        out[("without_routes", schedule)] = _skipping(schedule, routes=False)
    for name, schedule, checkpoint in RECOMPUTING:
        split = SPLITS[name] if schedule in VIRTUAL else SPLITS[name][1:2]
        out[("recompute", name, schedule)] = _following(
            name, schedule, checkpoint=checkpoint, split=split
        )
    for checkpoint in ("always", "never"):  # with dropout: the recompute draws the same
        out[("dropout", checkpoint)] = _following(
            "gpt2", "zb-v", checkpoint=checkpoint, dropout=0.1
        )
    out["deferred_batch_norm"] = _deferred_batch_norm()
    return out


RECOMPUTING = [("gpt2", "zb-v", "always"), ("llama", "1f1b", "except_last")]


def _deferred_batch_norm() -> dict[str, int]:
    """Two steps of a torchvision ResNet on two ranks with deferred batch norm and recompute:
    the times each of the rank's batch norms updated its statistics."""
    import torchvision

    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    pipe = ppd.wrap(
        model,
        split=["layer3"],
        chunks=4,
        schedule="1f1b",
        checkpoint="always",
        deferred_batch_norm=True,
    )
    for _ in range(2):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
        pipe.step(x, loss_fn=torch.nn.functional.cross_entropy, target=y)
    pipe.close()
    return {n: int(b) for n, b in pipe.named_buffers() if n.endswith("num_batches_tracked")}


def _four_ranks(rank: int) -> dict[str, Any]:
    return _following("gpt2", "zb-v", dp=2)


@pytest.fixture(scope="module")
def two() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.fixture(scope="module")
def four() -> dict[int, Any]:
    return spawn(4, _four_ranks)


def _plain_steps(name: str, *, batch: int = 4) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    torch.manual_seed(0)
    plain = zoo.build(name)
    steps = []
    for step in range(3):
        out = plain(**_batch(name, step, batch=batch))
        loss = out.float().logsumexp(-1).mean() if name.startswith("vit") else out.loss
        loss.backward()
        steps.append((loss.detach(), {n: p.grad.clone() for n, p in plain.named_parameters()}))
        plain.zero_grad()
    return steps


def _same_steps(got: dict[str, Any], name: str, where: str, *, batch: int = 4) -> set[str]:
    """Check every step of ``got`` against the plain model; return the weights it holds."""
    held: set[str] = set()
    for step, (expected, grads) in enumerate(_plain_steps(name, batch=batch)):
        ops, (loss, got_grads) = got["steps"][step]
        assert (ops == 0) == (step > 0), (where, step, ops)
        assert abs(loss - expected.item()) <= RTOL * abs(expected.item()), (where, step)
        for key, g in got_grads.items():
            ref = grads[key]
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"{where} step {step}: gradient of {key}, error {err:.2e}"
            held.add(key)
    return held


@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_two_stages_per_rank_equal_the_plain_model(
    two: dict[int, Any], name: str, schedule: str
) -> None:
    """Every step's loss and gradients are the plain model's; steps after the first run no
    operation under the cut's mode; every weight is on a rank; the rank of the last stage
    evaluates to the plain model's output."""
    torch.manual_seed(0)
    plain = zoo.build(name).eval()
    with torch.no_grad():
        out = plain(**_batch(name, 0))
    expected = out if name.startswith("vit") else out.logits
    held: set[str] = set()
    for r in (0, 1):
        got = two[r][(name, schedule)]
        assert got["stages"] == STAGES[schedule][r]
        held |= _same_steps(got, name, f"rank {r}")
        if 3 in got["stages"]:
            torch.testing.assert_close(torch.from_numpy(got["output"]), expected)
        else:
            assert got["output"] is None
    assert held == {n for n, _ in plain.named_parameters()}


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_a_rank_of_two_stages_is_sent_each_value_once(two: dict[int, Any], schedule: str) -> None:
    """GPT-2's first stage makes values that both stages of the other rank use (positions,
    the attention mask); they travel once, to the first of them, per micro-batch."""
    first, later = STAGES[schedule][1]  # the other rank's stages
    sent = two[0][("gpt2", schedule)]["messages"]
    assert sent[(0, first)] == 3 * 2, sent  # three steps of two micro-batches
    assert sent[(0, later)] == 0, sent


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_a_skipped_unit_of_another_rank_is_given_no_stand_ins(
    two: dict[int, Any], schedule: str
) -> None:
    """Following the route, a rank skips the other ranks' blocks (their outputs stood in): it
    sends its values to them but makes no meta stand-ins for arguments nothing reads."""
    for r in (0, 1):
        assert two[r][("gpt2", schedule)]["stand_ins"] == 0, r


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_a_step_that_leaves_the_route_ends_every_rank_with_the_cause(
    two: dict[int, Any], schedule: str
) -> None:
    for r in (0, 1):
        message = two[r][("path_change", schedule)]
        assert isinstance(message, str), (r, message)
        assert "took another path than the learned route" in message, (r, message)
        assert "pass routes=False to pipepar.distributed.wrap" in message, (r, message)


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_without_routes_every_path_is_right(two: dict[int, Any], schedule: str) -> None:
    torch.manual_seed(0)
    plain = Skipping()
    x = torch.rand(4, 4)
    expected = [plain(x, torch.full((4,), k)).square().mean().item() for k in (0, 0, 1, 0)]
    for r in (0, 1):
        got = two[r][("without_routes", schedule)]
        assert got == pytest.approx(expected, rel=RTOL), (r, got, expected)


def test_replicas_of_two_stages_per_rank_average_to_the_whole_batch(four: dict[int, Any]) -> None:
    """pp=2 x dp=2 under zb-v: each replica on its half of the batch, the gradients (GPT-2's
    tied embedding and head summed on one rank) averaged to the whole batch's."""
    held: set[str] = set()
    for r in range(4):
        assert four[r]["stages"] == STAGES["zb-v"][r % 2]
        held |= _same_steps(four[r], "gpt2", f"rank {r}", batch=8)
    assert held == {n for n, _ in zoo.gpt2().named_parameters()}


@pytest.mark.parametrize(("name", "schedule", "checkpoint"), RECOMPUTING)
def test_recomputing_ranks_equal_the_plain_model(
    two: dict[int, Any], name: str, schedule: str, checkpoint: str
) -> None:
    held: set[str] = set()
    for r in (0, 1):
        held |= _same_steps(two[r][("recompute", name, schedule)], name, f"rank {r}")
    assert held == {n for n, _ in zoo.build(name).named_parameters()}


def test_a_recompute_across_ranks_draws_what_the_forward_drew(two: dict[int, Any]) -> None:
    """With dropout, a rank that recomputes computes what one that keeps its activations does."""
    for r in (0, 1):
        recomputing, keeping = (two[r][("dropout", c)]["steps"] for c in ("always", "never"))
        for (_, (loss, grads)), (_, (loss_kept, grads_kept)) in zip(recomputing, keeping):
            assert loss == pytest.approx(loss_kept, rel=RTOL)
            for key, g in grads.items():
                torch.testing.assert_close(
                    torch.from_numpy(g), torch.from_numpy(grads_kept[key]), rtol=RTOL, atol=1e-7
                )


def test_deferred_batch_norm_across_ranks_updates_once_per_step(two: dict[int, Any]) -> None:
    """Over two steps (the second following the learned route: the top-level in-place ReLU of
    another rank's stage runs on a stood-in output), each batch norm is updated twice, on the
    rank of its stage."""
    counts = [two[r]["deferred_batch_norm"] for r in (0, 1)]
    assert (
        "bn1.num_batches_tracked" in counts[0] and "layer4.1.bn2.num_batches_tracked" in counts[0]
    )
    for name in counts[0]:
        assert sorted(c[name] for c in counts) == [0, 2], name
