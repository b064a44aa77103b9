"""torch.compile through the pipe (pipepar.core.compiled_units): blocks compiled before wrap,
``wrap(torch.compile(model))`` and ``compile=`` give the plain model's loss and gradients,
compile once (no recompile on later steps, none left eager) and keep the model's own names."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import pipepar
from models import transformers_zoo as zoo
from tests._ranks import spawn

CPU2 = ["cpu", "cpu"]
STEPS = 3
BACKEND = "aot_eager"  # Dynamo's tracing and AOTAutograd's one backward node, no C++ build


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return zoo.gpt2(layers=4, hidden=32, heads=2, vocab=64, positions=16)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _steps(pipe: nn.Module, call: Callable[[], torch.Tensor]) -> list[float]:
    """``STEPS`` steps: the first learns the cut (eager under its modes), the second compiles,
    the rest must run the compiled code without compiling again."""
    losses = []
    for k in range(STEPS):
        stance = torch.compiler.set_stance("fail_on_recompile") if k >= 2 else None
        with stance or contextlib.nullcontext():
            losses.append(float(call()))
        if k == 1:
            compiled = _graphs()
            assert compiled > 0, "the units ran eagerly: nothing was compiled"
    assert _graphs() == compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    return losses


def _check_plain(pipe: nn.Module, plain: nn.Module, losses: list[float]) -> None:
    ids = _ids()
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    assert losses == pytest.approx([loss.item()] * STEPS, abs=1e-5)
    own = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, STEPS * own[name].grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_blocks_compiled_before_wrap(schedule: str) -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    for block in model.transformer.h:
        block.compile(backend=BACKEND)
    pipe = pipepar.wrap(model, split=["transformer.h.2"], devices=CPU2, chunks=4, schedule=schedule)
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    _check_plain(pipe, plain, losses)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_zero_bubble_with_inductor_blocks_runs_their_backward_whole(schedule: str) -> None:
    """A block compiled by inductor has one backward node for its input and parameter
    gradients, and may have freed its buffers after running it once (AOTAutograd's donated
    buffers, here with transformers' key-value cache on): its stage's W cannot run it again,
    so B runs it whole. The second step crashed before ("donated buffers")."""
    model = _gpt2()
    model.config.use_cache = True
    plain = copy.deepcopy(model)
    for block in model.transformer.h:
        block.compile(backend="inductor")
    split = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    if schedule == "zb-h1":
        split = ["transformer.h.2"]
    pipe = pipepar.wrap(model, split=split, devices=CPU2, chunks=4, schedule=schedule)
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    _check_plain(pipe, plain, losses)


def test_compiled_model_keeps_its_names_and_options() -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        torch.compile(model, backend=BACKEND, dynamic=False),
        split=["transformer.h.2"],
        devices=CPU2,
        chunks=4,
        schedule="1f1b",
    )
    assert list(pipe.state_dict()) == list(plain.state_dict())
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    _check_plain(pipe, plain, losses)


def test_block_replaced_by_its_compiled_module() -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    for k, block in enumerate(model.transformer.h):
        model.transformer.h[k] = torch.compile(block, backend=BACKEND)
    pipe = pipepar.wrap(model, split=["transformer.h.2"], devices=CPU2, chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    _check_plain(pipe, plain, losses)


def test_compile_option_compiles_the_units() -> None:
    model = _gpt2()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, split=["transformer.h.2"], devices=CPU2, chunks=4, compile={"backend": BACKEND}
    )
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    _check_plain(pipe, plain, losses)


def test_compile_true_with_inductor_on_a_chain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=CPU2, chunks=2, compile=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    losses = _steps(pipe, lambda: pipe.step(x, y, nn.functional.mse_loss))
    assert losses == pytest.approx([expected.item()] * STEPS, rel=1e-5)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, STEPS * q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_option_of_a_wrong_type() -> None:
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        pipepar.wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], compile="yes")


def _ranks_body(rank: int) -> dict[str, object]:
    import pipepar.distributed as ppd

    pipe = ppd.wrap(
        _gpt2(), split=["transformer.h.2"], chunks=4, schedule="1f1b", compile={"backend": BACKEND}
    )
    ids = _ids()
    losses = _steps(pipe, lambda: pipe.step(input_ids=ids, labels=ids))
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters() if p.grad is not None}
    pipe.close()
    return {"losses": losses, "grads": grads}


@pytest.mark.slow
def test_compile_option_across_ranks() -> None:
    got = spawn(2, _ranks_body)
    plain = _gpt2()
    ids = _ids()
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    own = dict(plain.named_parameters())
    for rank, result in got.items():
        assert result["losses"] == pytest.approx([loss.item()] * STEPS, abs=1e-5), rank
        grads = result["grads"]
        assert isinstance(grads, dict) and grads, rank
        for name, g in grads.items():
            torch.testing.assert_close(
                torch.from_numpy(g), STEPS * own[name].grad, atol=1e-5, rtol=1e-4
            )
