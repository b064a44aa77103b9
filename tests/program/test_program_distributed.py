"""Real models under ``pipepar.distributed``: two gloo ranks on localhost, each computing one
stage of transformers' GPT-2 (tied head), Llama and BERT and of timm's and torchvision's ViT;
the loss and every gradient equal the plain model's, and tied copies stay equal over 20 steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("timm")

from models import transformers_zoo as zoo
from tests._ranks import spawn
from tests.program._real import Skipping, mode_calls, ranks_equal_plain

pytestmark = pytest.mark.slow
RTOL = 1e-5
SPLITS = {"gpt2": "transformer.h.2", "llama": "model.layers.2", "bert": "bert.encoder.layer.2"}
# One schedule per model here, each schedule on some model: every model x every schedule x
# every checkpoint mode is test_ranks_every_feature's.
SCHEDULES = {
    "gpt2": "1f1b",
    "llama": "gpipe",
    "bert": "zb-h1",
    "vit_timm": "1f1b",
    "vit_torchvision": "gpipe",
}
PADDED = {"gpt2": "zb-h1", "llama": "1f1b", "bert": "gpipe"}  # three micro-batches


def _loss_fn(name: str) -> Any:
    if name.startswith("vit"):
        return lambda out, _: out.float().logsumexp(-1).mean()
    return None


def _one_model(name: str) -> tuple[float, dict[str, Any]]:
    import pipepar
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build(name)
    state = copy.deepcopy(model.state_dict())
    n = len(pipepar.units(model))
    pipe = ppd.wrap(
        model, [n // 2, n - n // 2], chunks=4, schedule=SCHEDULES[name], state_dict=state
    )
    loss = pipe.step(**zoo.sample(name, batch=4), loss_fn=_loss_fn(name))
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads


def _tied_over_steps() -> list[Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.gpt2()
    pipe = ppd.wrap(model, split=["transformer.h.2"], chunks=2, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(20):
        pipe.step(**zoo.sample("gpt2", batch=4, seed=step))
        opt.step()
        opt.zero_grad()
    weight = model.transformer.wte.weight if pipe.stage_index == 0 else model.lm_head.weight
    out = weight.detach().numpy().copy()
    pipe.close()
    return out


def _replicas(rank: int) -> dict[str, Any]:
    """One stage, two data-parallel replicas, each on its own half of the batch."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.gpt2()
    n = len(__import__("pipepar").units(model))
    pipe = ppd.wrap(model, [n], chunks=2, dp=2)
    batch = {k: v.chunk(2)[rank] for k, v in zoo.sample("gpt2", batch=8).items()}
    pipe.step(**batch)
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return grads


def _padded(name: str, schedule: str) -> tuple[float, dict[str, Any]]:
    """Two stages; a padded batch whose micro-batches hold different numbers of labels."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.build(name)
    pipe = ppd.wrap(model, split=[SPLITS[name]], chunks=3, schedule=schedule)
    loss = pipe.step(**zoo.padded_sample(name))
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads


def _padded_replicas(rank: int) -> dict[str, Any]:
    """Two replicas of one stage, each with half of a padded batch (different label counts),
    for the model's own loss and for a loss_fn over tokens on an nn.Sequential."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.gpt2()
    n = len(__import__("pipepar").units(model))
    pipe = ppd.wrap(model, [n], chunks=2, dp=2)
    batch = {k: v.chunk(2)[rank] for k, v in zoo.padded_sample("gpt2", batch=8).items()}
    loss = pipe.step(**batch)
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    pipe.close()
    seq = _sequential()
    pipe = ppd.wrap(seq, [len(seq)], chunks=2, dp=2)
    x, y = _sequential_batch()
    seq_loss = pipe.step(x.chunk(2)[rank], y.chunk(2)[rank], torch.nn.functional.cross_entropy)
    seq_grads = [p.grad.numpy().copy() for p in pipe.parameters()]
    pipe.close()
    return {"loss": loss, "grads": grads, "seq_loss": seq_loss, "seq_grads": seq_grads}


def _evaluation() -> dict[str, Any]:
    """GPT-2 (dropout on, tied head) on two ranks validates a padded batch under no_grad
    (step, then pipe(...)), then trains on it, in eval mode still."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.gpt2(dropout=0.3)
    pipe = ppd.wrap(model, split=["transformer.h.2"], chunks=3, schedule="1f1b").eval()
    batch = zoo.padded_sample("gpt2")
    seen: list[bool] = []  # every block, the shadow ones too: run with gradients enabled?
    hooks = [
        block.register_forward_hook(lambda m, a, out: seen.append(torch.is_grad_enabled()))
        for block in model.transformer.h
    ]
    with torch.no_grad():
        loss, out = pipe.step(**batch), pipe(**batch)
    with torch.inference_mode():
        loss_inference = pipe.step(**batch)
    for hook in hooks:
        hook.remove()
    untouched = all(p.grad is None for p in pipe.parameters())
    try:
        pipe(**batch)
        refused = ""
    except TypeError as e:
        refused = str(e)
    result = {
        "loss": loss,
        "loss_inference": loss_inference,
        "logits": None if out is None else out.logits.numpy().copy(),
        "out_loss": None if out is None else out.loss.item(),
        "training": model.training,
        "no_graph": bool(seen) and not any(seen),
        "untouched": untouched,
        "refused": refused,
        "loss_train": pipe.step(**batch),
        "grads": {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()},
    }
    pipe.close()
    return result


def _sequential() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))


def _sequential_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    return x, torch.tensor([1, -100, -100, -100, 2, 3, 4, -100])


FOLLOW_SPLITS = {
    **SPLITS,
    "vit_timm": "blocks.2",
    "vit_torchvision": "encoder.layers.encoder_layer_2",
}


def _follow_batch(name: str, step: int) -> dict[str, Any]:
    if name.startswith("vit"):
        return zoo.sample(name, batch=4, seed=step % 2)
    return zoo.padded_sample(name, batch=4, seq=8, seed=step % 2)


def _following(name: str, schedule: str) -> list[tuple[int, float, dict[str, Any]]]:
    """Three steps of the same kind: the first learns the route, the others follow it (the
    count of operations that passed the cut's mode, the loss, the gradients of each step)."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    pipe = ppd.wrap(zoo.build(name), split=[FOLLOW_SPLITS[name]], chunks=2, schedule=schedule)
    steps = []
    for step in range(3):
        with mode_calls() as count:
            loss = pipe.step(**_follow_batch(name, step), loss_fn=_loss_fn(name))
        grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
        pipe.zero_grad()
        steps.append((count[0], loss, grads))
    pipe.close()
    return steps


def _head_calls(schedule: str) -> list[int]:
    """How many times this rank ran into the head (the last unit) in each of three steps of
    one kind of call."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = zoo.gpt2()
    calls = [0]
    model.lm_head.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    split = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    pipe = ppd.wrap(model, split=split if schedule == "zb-v" else split[1:2], chunks=2,
                    schedule=schedule)  # fmt: skip
    seen = []
    for step in range(3):
        calls[0] = 0
        pipe.step(**_follow_batch("gpt2", step))
        seen.append(calls[0])
    pipe.close()
    return seen


def _path_change() -> str:
    """A step that leaves the route its kind of call learned ends every rank with the cause."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    pipe = ppd.wrap(Skipping(), split=["blocks.2"], chunks=2, timeout=30)
    x = torch.rand(4, 4)
    for _ in range(2):
        pipe.step(x, torch.zeros(4, dtype=torch.long), loss_fn=lambda out, t: out.sum(), target=x)
    try:
        pipe.step(x, torch.ones(4, dtype=torch.long), loss_fn=lambda out, t: out.sum(), target=x)
    except ppd.PipelineError as error:
        return str(error)
    finally:
        pipe.close()
    return "no error"


def _without_routes() -> list[float]:
    """``routes=False``: every call under the cut's mode, whatever path it takes."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    pipe = ppd.wrap(Skipping(), split=["blocks.2"], chunks=2, routes=False)
    x = torch.rand(4, 4)
    losses = [
        pipe.step(x, torch.full((4,), k), loss_fn=lambda out, t: out.square().mean())
        for k in (0, 0, 1, 0)
    ]
    pipe.close()
    return losses


def _disagreeing(rank: int) -> dict[str, str]:
    """Each rank wraps with its own arguments; what each one raises."""
    import pipepar.distributed as ppd

    cases = {
        "chunks": {"chunks": 2 if rank == 0 else 4},
        "routes": {"routes": rank == 1, "chunks": 2},
        "refused": {"chunks": 0 if rank == 1 else 2},
    }
    out = {}
    for label, options in cases.items():
        try:
            ppd.wrap(Skipping(), split=["blocks.2"], timeout=30, **options).close()
            out[label] = "no error"
        except ValueError as error:
            out[label] = str(error)
    return out


def _activation_messages() -> list[int]:
    """How many activation messages this rank posted (sends and receives) in each of three
    steps of Llama over two ranks (1f1b, two micro-batches)."""
    import pipepar.distributed as ppd
    from pipepar.program import rank_messages as link

    torch.manual_seed(0)
    pipe = ppd.wrap(zoo.llama(), split=[SPLITS["llama"]], chunks=2, schedule="1f1b")
    posts = [0]
    post = link.RankMessages._post

    def counted(self: Any, op: Any, t: Any, what: str, kind: int, peer: int, tag: int) -> Any:
        posts[0] += kind == link.ACTIVATION
        return post(self, op, t, what, kind, peer, tag)

    link.RankMessages._post = counted  # type: ignore[method-assign]
    try:
        seen = []
        for step in range(3):
            posts[0] = 0
            pipe.step(**_follow_batch("llama", step))
            seen.append(posts[0])
    finally:
        link.RankMessages._post = post  # type: ignore[method-assign]
        pipe.close()
    return seen


def _two_ranks(rank: int) -> dict[str, Any]:
    out = {name: _one_model(name) for name in zoo.NAMES}
    out["tied"] = _tied_over_steps()
    out["replicas"] = _replicas(rank)
    out["padded"] = {(name, PADDED[name]): _padded(name, PADDED[name]) for name in SPLITS}
    out["padded_replicas"] = _padded_replicas(rank)
    out["eval"] = _evaluation()
    out["head_calls"] = {schedule: _head_calls(schedule) for schedule in ("1f1b", "zb-v")}
    out["messages"] = _activation_messages()
    out["path_change"] = _path_change()
    out["without_routes"] = _without_routes()
    out["following"] = {
        (name, SCHEDULES[name]): _following(name, SCHEDULES[name]) for name in zoo.NAMES
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_two_ranks_equal_the_plain_model(ranks: dict[int, Any], name: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    batch = zoo.sample(name, batch=4)
    out = plain(**batch)
    loss = out.float().logsumexp(-1).mean() if name.startswith("vit") else out.loss
    loss.backward()
    ranks_equal_plain([ranks[r][name] for r in (0, 1)], loss, plain)


def test_tied_copies_stay_equal_over_twenty_steps(ranks: dict[int, Any]) -> None:
    first, last = ranks[0]["tied"], ranks[1]["tied"]
    assert (first == last).all(), "the embedding (rank 0) and the head (rank 1) drifted apart"
    torch.manual_seed(0)
    plain = zoo.gpt2()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(20):
        plain(**zoo.sample("gpt2", batch=4, seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(
        torch.from_numpy(first), plain.lm_head.weight.detach(), rtol=1e-4, atol=1e-6
    )


def test_replicas_average_to_the_whole_batch(ranks: dict[int, Any]) -> None:
    torch.manual_seed(0)
    plain = zoo.gpt2()
    plain(**zoo.sample("gpt2", batch=8)).loss.backward()
    for r in (0, 1):
        for key, g in ranks[r]["replicas"].items():
            ref = dict(plain.named_parameters())[key].grad
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"


@pytest.mark.parametrize(("name", "schedule"), PADDED.items())
def test_token_losses_across_ranks_equal_the_plain_model(
    ranks: dict[int, Any], name: str, schedule: str
) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    loss = plain(**zoo.padded_sample(name)).loss
    loss.backward()
    grads = dict(plain.named_parameters())
    scale = max(p.grad.abs().max().item() for p in plain.parameters())
    for r in (0, 1):
        got_loss, got = ranks[r]["padded"][(name, schedule)]
        assert abs(got_loss - loss.item()) <= RTOL * abs(loss.item()), (r, got_loss, loss.item())
        for key, g in got.items():
            err = (torch.from_numpy(g) - grads[key].grad).abs().max().item() / scale
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"


def test_replicas_join_token_losses_over_the_global_batch(ranks: dict[int, Any]) -> None:
    torch.manual_seed(0)
    plain = zoo.gpt2()
    loss = plain(**zoo.padded_sample("gpt2", batch=8)).loss
    loss.backward()
    seq = _sequential()
    x, y = _sequential_batch()
    seq_loss = torch.nn.functional.cross_entropy(seq(x), y)
    seq_loss.backward()
    for r in (0, 1):
        got = ranks[r]["padded_replicas"]
        assert abs(got["loss"] - loss.item()) <= RTOL * loss.item()
        assert abs(got["seq_loss"] - seq_loss.item()) <= RTOL * seq_loss.item()
        for key, g in got["grads"].items():
            ref = dict(plain.named_parameters())[key].grad
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"
        for g, p in zip(got["seq_grads"], seq.parameters()):
            torch.testing.assert_close(torch.from_numpy(g), p.grad, rtol=RTOL, atol=1e-7)


def test_evaluation_across_ranks_runs_forwards_only_and_gives_the_output_on_the_last_stage(
    ranks: dict[int, Any],
) -> None:
    torch.manual_seed(0)
    plain = zoo.gpt2(dropout=0.3).eval()
    out = plain(**zoo.padded_sample("gpt2"))
    out.loss.backward()  # the training step after the evaluation must find these gradients
    grads = dict(plain.named_parameters())
    scale = max(p.grad.abs().max().item() for p in plain.parameters())
    expected = out.loss.item()
    for r in (0, 1):
        got = ranks[r]["eval"]
        assert abs(got["loss"] - expected) <= RTOL * expected, (r, got["loss"], expected)
        assert got["loss_inference"] == got["loss"]
        assert got["no_graph"], f"rank {r}: a block ran with gradients enabled"
        assert got["untouched"], f"rank {r}: evaluation wrote .grad"
        assert not got["training"], "pipe.eval() left the model's own flag in training mode"
        assert "under torch.no_grad()" in got["refused"]
        if r == 1:  # the last stage: the model's output, joined over the micro-batches
            logits = torch.from_numpy(got["logits"])
            torch.testing.assert_close(logits, out.logits.detach(), rtol=RTOL, atol=1e-6)
            assert abs(got["out_loss"] - expected) <= RTOL * expected
        else:
            assert got["logits"] is None
        assert abs(got["loss_train"] - expected) <= RTOL * expected
        for key, g in got["grads"].items():
            err = (torch.from_numpy(g) - grads[key].grad).abs().max().item() / scale
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"


@pytest.mark.parametrize(("name", "schedule"), SCHEDULES.items())
def test_ranks_following_a_route_equal_the_plain_model(
    ranks: dict[int, Any], name: str, schedule: str
) -> None:
    """After the first step, each rank runs its own stage without the cut's mode and skips the
    other stage's units; every step's loss and gradients are the plain model's."""
    torch.manual_seed(0)
    plain = zoo.build(name)
    for step in range(3):
        out = plain(**_follow_batch(name, step))
        loss = out.float().logsumexp(-1).mean() if name.startswith("vit") else out.loss
        loss.backward()
        grads = dict(plain.named_parameters())
        for r in (0, 1):
            ops, got_loss, got = ranks[r]["following"][(name, schedule)][step]
            assert (ops == 0) == (step > 0), (r, step, ops)
            assert abs(got_loss - loss.item()) <= RTOL * abs(loss.item()), (r, step)
            for key, g in got.items():
                ref = grads[key].grad
                scale = ref.abs().max().clamp_min(1e-6)
                err = ((torch.from_numpy(g) - ref).abs().max() / scale).item()
                assert err < RTOL, f"rank {r} step {step}: gradient of {key}, error {err:.2e}"
        plain.zero_grad()


def test_the_values_a_unit_call_takes_from_another_rank_travel_in_one_message(
    ranks: dict[int, Any],
) -> None:
    """Llama's first layer of the second stage takes the hidden states, the rotary cosines
    and sines and the positions from the first stage: one message per micro-batch, sent by
    rank 0 and received by rank 1 (two micro-batches a step; the later layers reuse them).
    (The results are the plain model's: tests above.)"""
    assert ranks[0]["messages"] == [2, 2, 2]
    assert ranks[1]["messages"] == [2, 2, 2]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_rank_stops_following_a_forward_once_it_has_sent_its_values(
    ranks: dict[int, Any], schedule: str
) -> None:
    """Once a route is learned, a rank with no stage after the one it follows leaves the
    micro-batch's forward when the route's sends are made: the head (last stage) is run (as a
    stand-in, or for real) by the first step's every micro-batch on every rank, and later only
    by the rank that computes it. (The results are the plain model's: tests above.)"""
    last = 0 if schedule == "zb-v" else 1  # zb-v puts stages 0 and 3 on rank 0
    for r in (0, 1):
        expected = [2, 2, 2] if r == last else [2, 0, 0]
        assert ranks[r]["head_calls"][schedule] == expected, (r, schedule)


def test_a_step_that_leaves_the_route_ends_every_rank_with_the_cause(
    ranks: dict[int, Any],
) -> None:
    for r in (0, 1):
        message = ranks[r]["path_change"]
        assert "took another path than the learned route" in message, (r, message)
        assert "pass routes=False to pipepar.distributed.wrap" in message, (r, message)


def test_without_routes_every_path_is_right(ranks: dict[int, Any]) -> None:
    torch.manual_seed(0)
    plain = Skipping()
    x = torch.rand(4, 4)
    expected = [plain(x, torch.full((4,), k)).square().mean().item() for k in (0, 0, 1, 0)]
    for r in (0, 1):
        got = ranks[r]["without_routes"]
        assert got == pytest.approx(expected, rel=RTOL), (r, got, expected)


def test_ranks_that_disagree_at_wrap_all_fail_naming_both_values() -> None:
    got = spawn(2, _disagreeing)
    for r in (0, 1):
        assert "chunks is 2 on rank(s) [0] but 4 on rank(s) [1]" in got[r]["chunks"], got[r]
        assert "routes is False on rank(s) [0] but True on rank(s) [1]" in got[r]["routes"]
        assert "chunks" in got[r]["refused"], got[r]
    assert got[0]["refused"].startswith("rank 1 refused the arguments of ppd.wrap")


def test_gradients_are_awaited_early_only_where_backwards_keep_the_forwards_order() -> None:
    """A rank posts the receive of a sent value's gradient when it sends the value, so the
    peer's send finds it waiting; the messages of a pair of stages then meet those receives in
    the order they were posted, which holds where every stage runs its backwards in the order
    of its forwards (not under GPipe, whose backwards run last micro-batch first)."""
    from pipepar.core.named_schedules import gpipe, make
    from pipepar.core.schedule import parse

    assert not gpipe(2, 4).in_order()
    for name, stages in (("1f1b", 2), ("zb-h1", 2), ("interleaved-1f1b", 4), ("zb-v", 4)):
        assert make(name, stages, 8, n_workers=2).in_order(), name
    assert not parse(["F0 F1 B1 B0", "F0 F1 B0 B1"]).in_order()
