"""The activation store and the offload plan: what goes to host memory, when it comes back, and
that a backward from what came back computes exactly what it computes from what never left."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from pipepar.core.named_schedules import NAMES, make
from pipepar.core.offload import ActivationStore
from pipepar.core.offload_plan import plan_offload
from pipepar.core.validation import check_offload

CPU = torch.device("cpu")


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [g for g in torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])]


def _offloaded_grads(
    store: ActivationStore, model: nn.Module, x: torch.Tensor, *, reload: bool
) -> list[torch.Tensor]:
    with store.saving(0):
        loss = model(x).square().sum()
    if reload:
        store.reload(0)
    grads = list(torch.autograd.grad(loss, [x, *model.parameters()]))
    store.release(0)
    return grads


@pytest.mark.parametrize("reload", [True, False], ids=["reloaded", "late"])
def test_a_backward_from_what_came_back_is_bit_equal(reload: bool) -> None:
    model, x = _block(), torch.randn(32, 64, requires_grad=True)
    store = ActivationStore(CPU, model.parameters(), min_bytes=0)
    got = _offloaded_grads(store, model, x, reload=reload)
    for a, b in zip(got, _grads(model, x), strict=True):
        assert torch.equal(a, b)
    # Linear 2's input, GELU's input and Tanh's result went out (x is the caller's).
    assert store.counts.tensors == 3
    assert store.counts.sent == 3 * 32 * 64 * 4
    assert (store.counts.reloaded, store.counts.late) == (
        (store.counts.sent, 0) if reload else (0, store.counts.sent)
    )


def test_weights_small_gapped_and_referenced_tensors_stay() -> None:
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 128, requires_grad=True)
    store = ActivationStore(CPU, lin.parameters(), min_bytes=1024)
    with store.saving(0):
        gapped = x[:, ::2]  # a view with gaps: saved by lin, it stays (its copy would differ)
        doubled = x * 2  # the caller keeps it (and sin's result): nothing to free
        kept_alive = doubled.sin()
        loss = lin(gapped).sum() + (kept_alive * kept_alive).sum() + torch.ones(4).exp().sum()
    assert store.counts.tensors == 0  # the weight, the gapped view, live tensors, 16 bytes
    x.grad = None
    store.reload(0)
    loss.backward()
    assert x.grad is not None


def test_transposed_and_low_precision_tensors_come_back_as_they_were() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)

    def f() -> torch.Tensor:
        h = (x.t() @ w.t()).relu()  # relu's result saved; the product saves x.t(), w.t()
        return (h.t().contiguous().t() * 3).sum()

    want = torch.autograd.grad(f(), [x, w])
    store = ActivationStore(CPU, [], min_bytes=0)
    unpack, seen = store._unpack, []

    def spy(packed: object) -> torch.Tensor:  # what the backward reads, as it reads it
        back = unpack(packed)  # type: ignore[arg-type]
        seen.append((back.dtype, back.stride(), isinstance(packed, torch.Tensor)))
        return back

    store._unpack = spy  # type: ignore[method-assign]
    with store.saving(0):
        loss = f()
    got = torch.autograd.grad(loss, [x, w])
    # relu's result came back, and x.t() (kept: x is the caller's) as a view with its strides
    assert {(torch.bfloat16, (48, 1), False), (torch.bfloat16, (1, 64), False)} <= set(seen)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _squared_exp(x: torch.Tensor) -> torch.Tensor:
    h = x.exp()  # saved three times: exp's result, and both factors of the product
    return (h * h).sum()


def test_a_tensor_saved_three_times_goes_out_once_and_comes_back_once() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    store = ActivationStore(CPU, [], min_bytes=0)
    with store.saving(0):
        loss = _squared_exp(x)
    assert store.counts.tensors == 1
    store.reload(0)
    (g,) = torch.autograd.grad(loss, [x])
    assert store.counts.late == 0
    assert torch.equal(g, torch.autograd.grad(_squared_exp(x), [x])[0])


def test_an_outer_pack_hook_is_asked_first() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    replaced = []

    def first(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and t.shape[0] == 64 and t is not x:
            replaced.append(t)
            return t.detach().clone()
        return t

    store = ActivationStore(CPU, [], min_bytes=0)
    with store.saving(0, first):
        loss = x.exp().sin().sum()
    assert replaced and store.counts.tensors == 0
    assert torch.equal(torch.autograd.grad(loss, [x])[0], (x.exp().cos() * x.exp()).detach())


def test_what_came_back_lives_as_long_as_autograd_holds_what_views_it() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    for retain in (False, True):
        store = ActivationStore(CPU, [], min_bytes=0)
        with store.saving(0):
            loss = x.exp().sin().sum()
        assert store.counts.resident == 0  # away
        store.reload(0)
        assert store.counts.resident == store.counts.sent > 0
        loss.backward(retain_graph=retain)
        gc.collect()
        assert (store.counts.resident > 0) == retain  # the graph kept holds it
        del loss
        gc.collect()
        assert store.counts.resident == 0  # the graph is gone: so is what it saved
        store.release(0)


def test_a_backward_frees_what_came_back_as_it_goes() -> None:
    """Each block goes when the backward is done with the operation that saved it, as the
    original would have: the first operation's backward runs with the last one's freed."""
    x = torch.randn(128, 128, requires_grad=True)
    store = ActivationStore(CPU, [], min_bytes=0)
    seen: list[int] = []
    with store.saving(0):
        h = x.exp()  # its result saved (by exp and sin): it lives until exp's backward
        h.register_hook(lambda g: seen.append(store.counts.resident))
        loss = h.sin().square().sum()  # and sin's result (saved by square)
        del h
    store.reload(0)
    whole = store.counts.resident
    loss.backward()
    assert whole == 2 * x.numel() * 4 and seen == [x.numel() * 4]  # exp's result alone


def _attention_like(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)  # views with gaps of one storage
    out = (q * k).softmax(-1) * v  # saves q, k, v, and softmax's result
    return out.reshape(-1).sin().sum() + out.cos().sum()  # out, saved reshaped and as itself


def test_views_of_one_storage_go_out_once_and_come_back_as_one_block() -> None:
    lin = nn.Linear(32, 96)
    x = torch.randn(64, 32)
    want = torch.autograd.grad(_attention_like(lin(x)), list(lin.parameters()))
    store = ActivationStore(CPU, lin.parameters(), min_bytes=1024)
    with store.saving(0):
        loss = _attention_like(lin(x))
    block = 64 * 32 * 4
    # lin's output whole (once for its three gapped views), softmax's result, out (once)
    assert (store.counts.tensors, store.counts.sent) == (3, 3 * block + 2 * block)
    store.reload(0)
    assert store.counts.resident == store.counts.sent
    got = torch.autograd.grad(loss, list(lin.parameters()))
    assert store.counts.late == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# -- the plan --------------------------------------------------------------------------------


def test_1f1b_sends_what_waits_and_brings_it_back_one_action_early() -> None:
    plan = plan_offload(make("1f1b", 4, 8, n_workers=4))
    assert {i for s, i in plan.sent if s == 0} == set(range(8))
    assert not {i for s, i in plan.sent if s == 3}  # the last stage's B follows its F
    assert plan.reloads[(0, "F", 3)] == ((0, 0),)  # stage 0: F0 F1 F2 F3 B0 ...


@pytest.mark.parametrize("name", NAMES)
def test_every_reload_starts_between_forward_and_backward_on_the_same_worker(name: str) -> None:
    n = 8 if name in ("interleaved-1f1b", "zb-v", "v-half", "v-min") else 4
    schedule = make(name, n, 8, n_workers=4)
    plan = plan_offload(schedule)
    assert plan.sent  # every schedule has micro-batches that wait
    for actions in schedule.actions:
        where = {(a.stage, a.kind, a.microbatch): k for k, a in enumerate(actions)}
        for trigger, keys in plan.reloads.items():
            if trigger not in where:
                continue
            for s, i in keys:
                forward, backward = where[(s, "F", i)], where[(s, "B", i)]
                assert forward + 1 < where[trigger] < backward


def test_plan_and_option_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"lead and away must be at least 1.*lead=0"):
        plan_offload(make("1f1b", 2, 4, n_workers=2), lead=0)
    with pytest.raises(TypeError, match="offload must be True or False, but got 'yes'"):
        check_offload("yes")
