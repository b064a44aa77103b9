"""torch.distributed.pipelining's split points through ``pipepar.distributed.wrap`` on two gloo
ranks: ``pipe_split()`` markers found on a sample (the model real, or built on meta with a
state_dict) and a ``split_spec`` on transformers' GPT-2 place the stages where they say; the
loss and every gradient equal the plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.pipelining import SplitPoint

from tests._ranks import spawn
from tests.program._marked import Marked, Normed, batch, loss_fn

pytestmark = pytest.mark.slow
RTOL = 1e-5
GPT2_SPEC = {"transformer.h.2": SplitPoint.BEGINNING}


def _result(pipe: Any, loss: float) -> dict[str, Any]:
    grads = {k: p.grad.numpy().copy() for k, p in pipe.named_parameters()}
    out = {"balance": list(pipe.balance), "loss": loss, "grads": grads}
    pipe.close()
    return out


def _marked(on_meta: bool) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    state = copy.deepcopy(Marked((2,)).state_dict())
    if on_meta:
        with torch.device("meta"):
            model = Marked((2,))
    else:
        model = Marked((2,))
    ids, target = batch()
    pipe = ppd.wrap(model, sample=ids, chunks=2, schedule="1f1b", state_dict=state)
    return _result(pipe, pipe.step(ids, loss_fn=loss_fn, target=target))


def _gpt2() -> dict[str, Any]:
    import pipepar.distributed as ppd
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    pipe = ppd.wrap(zoo.gpt2(), split_spec=GPT2_SPEC, chunks=2, schedule="gpipe")
    return _result(pipe, pipe.step(**zoo.sample("gpt2", batch=4)))


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def _normed() -> dict[str, Any]:
    """Training-mode batch norms and dropouts, ``pipe_split()`` before ``blocks.1``: whether
    wrap left every buffer this rank keeps and the random state as they were; then one step
    (dropouts off: each rank draws its own) and the buffers it made."""
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    model = Normed(1)
    x, y = _rows()
    before = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    pipe = ppd.wrap(model, sample=x, chunks=1, deferred_batch_norm=False)
    kept = [k for k, b in model.named_buffers() if not b.is_meta]
    changed = [k for k, b in model.named_buffers() if k in kept and not torch.equal(b, before[k])]
    drew = not torch.equal(torch.get_rng_state(), rng)
    for block in model.blocks:
        block[3].p = 0.0
    loss = pipe.step(x, loss_fn=torch.nn.functional.cross_entropy, target=y)
    after = {k: b.detach().numpy().copy() for k, b in model.named_buffers() if not b.is_meta}
    return {**_result(pipe, loss), "changed": changed, "drew": drew, "buffers": after}


def _two_ranks(rank: int) -> dict[str, Any]:
    return {"real": _marked(False), "meta": _marked(True), "gpt2": _gpt2(), "bn": _normed()}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    pytest.importorskip("transformers")
    return spawn(2, _two_ranks)


def _same_as_plain(ranks: dict[int, Any], key: str, plain: torch.nn.Module, loss: Any) -> None:
    loss.backward()
    grads = dict(plain.named_parameters())
    seen: set[str] = set()
    for r in (0, 1):
        got = ranks[r][key]
        assert abs(got["loss"] - loss.item()) <= RTOL * abs(loss.item()), (r, got["loss"])
        for name, g in got["grads"].items():
            ref = grads[name].grad
            err = ((torch.from_numpy(g) - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            assert err < RTOL, f"rank {r}: gradient of {name}, relative error {err:.2e}"
            seen.add(name)
    assert seen == set(grads), f"no rank holds {set(grads) - seen}"


@pytest.mark.parametrize("key", ["real", "meta"])
def test_markers_split_the_model_across_ranks(ranks: dict[int, Any], key: str) -> None:
    """The stage on rank 1 begins at ``blocks.2``, where the forward calls ``pipe_split()``:
    emb, blocks.0, blocks.1 | blocks.2, blocks.3, norm, head."""
    assert ranks[0][key]["balance"] == ranks[1][key]["balance"] == [3, 4]
    torch.manual_seed(0)
    plain = Marked((2,))
    ids, target = batch()
    _same_as_plain(ranks, key, plain, loss_fn(plain(ids), target))


def test_split_spec_splits_gpt2_across_ranks(ranks: dict[int, Any]) -> None:
    import pipepar
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    plain = zoo.gpt2()
    paths = [u.path for u in pipepar.units(plain)]
    assert ranks[0]["gpt2"]["balance"][0] == paths.index("transformer.h.2")
    _same_as_plain(ranks, "gpt2", plain, plain(**zoo.sample("gpt2", batch=4)).loss)


def test_markers_leave_training_batch_norm_and_random_state_alone(ranks: dict[int, Any]) -> None:
    """Found by the plain model's forward of the sample (4 rows through training-mode batch
    norms: one row would fail), the markers split it; wrap changed no buffer a rank keeps and
    drew no random number; one step equals the plain model's, running statistics included."""
    for r in (0, 1):
        got = ranks[r]["bn"]
        assert got["balance"] == [2, 3], got["balance"]
        assert not got["changed"], f"rank {r}: wrap changed {got['changed']}"
        assert not got["drew"], f"rank {r}: wrap drew random numbers"
    torch.manual_seed(0)
    plain = Normed(1, p=0.0)
    x, y = _rows()
    _same_as_plain(ranks, "bn", plain, torch.nn.functional.cross_entropy(plain(x), y))
    stage = {0: ("inp", "blocks.0"), 1: ("blocks.1", "blocks.2", "head")}
    for r, units in stage.items():
        for name, b in plain.named_buffers():
            if name.startswith(tuple(u + "." for u in units)):
                got = torch.from_numpy(ranks[r]["bn"]["buffers"][name])
                assert torch.allclose(got, b.to(got.dtype), rtol=RTOL, atol=1e-7), (r, name, got, b)
