"""untouched: whatever a forward stores on its modules is put back, by identity and by value."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from pipepar.core.untouched import untouched
from tests._llama70b import llama3_70b_bf16


class _Counting(nn.Module):
    """Counts its calls in a plain int, keeps a list of the rows it saw and a dict of flags."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.calls = 0
        self.rows: list[int] = []
        self.flags = {"seen": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.rows.append(x.shape[0])
        self.flags["seen"] = True
        self.last_rows = x.shape[0]  # an attribute the forward adds
        return self.layer(x)


class _Growing(nn.Module):
    """What dynamic rotary embeddings do: a new buffer object registered, a length recorded, a
    submodule and a hook added on the first call, a plain tensor written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.ones(3), persistent=False)
        self.longest = 2
        self.total = torch.zeros(())  # a plain tensor attribute, written in place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.longest:
            self.register_buffer("freq", torch.full((3,), 0.5), persistent=False)
            self.longest = x.shape[0]
            self.extra = nn.Linear(3, 3)
            self.register_forward_hook(lambda *_: None)
        self.total += x.sum()
        return x * self.freq


def test_a_counter_a_list_a_dict_and_an_added_attribute_are_put_back() -> None:
    model = _Counting()
    rows, flags = model.rows, model.flags
    with untouched(model):
        model(torch.randn(5, 4))
    assert model.calls == 0 and model.rows == [] and model.flags == {"seen": False}
    assert model.rows is rows and model.flags is flags  # the same containers, refilled
    assert not hasattr(model, "last_rows")


def test_a_replaced_buffer_a_new_submodule_and_a_new_hook_are_put_back() -> None:
    model = nn.Sequential(_Growing())
    grow = model[0]
    freq, total = grow.freq, grow.total
    with untouched(model):
        model(torch.ones(4, 3))
    assert grow.freq is freq and torch.equal(freq, torch.ones(3))
    assert grow.total is total and float(total) == 0.0
    assert grow.longest == 2 and "extra" not in grow._modules and not grow._forward_hooks
    assert dict(grow.named_buffers()) == {"freq": freq} and grow._non_persistent_buffers_set == {
        "freq"
    }


def test_a_buffer_written_in_place_by_a_kernel_is_put_back() -> None:
    """Batch norm's kernel updates running statistics without moving their version counter."""
    bn = nn.BatchNorm1d(3)
    mean = bn.running_mean.clone()
    with untouched(bn):
        bn(torch.randn(8, 3) + 5)
    assert torch.equal(bn.running_mean, mean) and int(bn.num_batches_tracked) == 0


def test_random_states_and_gradients_are_put_back() -> None:
    layer = nn.Linear(2, 2)
    layer.weight.grad = grad = torch.ones(2, 2)
    rng = torch.get_rng_state()
    with untouched(layer):
        torch.rand(3)
        layer.weight.grad = None
        layer.bias.grad = torch.ones(2)
    assert layer.weight.grad is grad and layer.bias.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_forward_that_writes_a_weight_in_place_is_named() -> None:
    layer = nn.Linear(2, 2)
    match = r"wrote parameter weight in place.*balance="
    with pytest.raises(ValueError, match=match), untouched(layer), torch.no_grad():
        layer.weight.mul_(2)


def test_a_view_of_a_weight_held_as_an_attribute_is_not_copied_nor_reported() -> None:
    layer = nn.Linear(2, 2)
    layer.transposed = layer.weight.detach().t()
    with untouched(layer):
        layer.transposed = None
    assert layer.transposed is not None and layer.transposed.data_ptr() == layer.weight.data_ptr()


def test_an_error_inside_still_puts_the_model_back() -> None:
    model = _Counting()
    with pytest.raises(RuntimeError, match="boom"), untouched(model):
        model(torch.randn(2, 4))
        raise RuntimeError("boom")
    assert model.calls == 0 and not hasattr(model, "last_rows")


def _attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {path: dict(m.__dict__) for path, m in model.named_modules()}


def test_a_70b_shaped_meta_model_is_looked_at_cheaply() -> None:
    """Nothing on meta is copied: the snapshot walks ~2000 modules' attributes."""
    model = llama3_70b_bf16()  # the session's one: put back as it was
    before = _attributes(model)
    start = time.perf_counter()
    with untouched(model):
        model.model.rotary_emb.max_seq_len_cached = 1
    took = time.perf_counter() - start
    assert _attributes(model) == before
    assert took < 2.0, f"untouched took {took:.2f} s on a meta model"


def test_a_lazy_module_is_refused_before_its_forward_creates_weights() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"lazy.*0\.weight.*model\(sample\)"), untouched(model):
        model(torch.randn(2, 3))
    assert nn.parameter.is_lazy(model[0].weight)
