"""Real models under ``pipepar.distributed``: two gloo ranks on localhost, each computing one
stage of transformers' GPT-2 (tied head), Llama and BERT and of timm's and torchvision's ViT;
the loss and every gradient equal the plain model's, and tied copies stay equal over 20 steps."""

from __future__ import annotations

import copy
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("timm")

from models import transformers_zoo as zoo

pytestmark = pytest.mark.slow
RTOL = 1e-5
SCHEDULES = {
    "gpt2": "1f1b",
    "llama": "gpipe",
    "bert": "zb-h1",
    "vit_timm": "1f1b",
    "vit_torchvision": "gpipe",
}


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


def _rank(rank: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {name: _one_model(name) for name in zoo.NAMES}
        out["tied"] = _tied_over_steps()
        out["replicas"] = _replicas(rank)
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    for r, value in got.items():
        assert not isinstance(value, str), f"rank {r} failed:\n{value}"
    return got


@pytest.mark.parametrize("name", zoo.NAMES)
def test_two_ranks_equal_the_plain_model(ranks: dict[int, Any], name: str) -> None:
    torch.manual_seed(0)
    plain = zoo.build(name)
    batch = zoo.sample(name, batch=4)
    out = plain(**batch)
    loss = out.float().logsumexp(-1).mean() if name.startswith("vit") else out.loss
    loss.backward()
    grads = dict(plain.named_parameters())
    seen: set[str] = set()
    for r in (0, 1):
        got_loss, got = ranks[r][name]
        assert abs(got_loss - loss.item()) <= RTOL * abs(loss.item())
        for key, g in got.items():
            ref = grads[key].grad
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"rank {r}: gradient of {key}, relative error {err:.2e}"
            seen.add(key)
    assert seen == set(grads), f"no rank holds {set(grads) - seen}"


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
