"""Operations whose meta kernel cannot give their outputs: a data-dependent one on known values
takes its shapes (and values) from them, a kernel stricter on meta than on the CPU
(``grouped_mm`` in float32) from another dtype, and one on an activation's values raises naming
the operation and the module; the profile of a model whose router reads activations measures
its split backwards on the real device, and planning a mixture-of-experts model from a sample
gives the plain model's loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipepar.meta.fallback import MetaUnsupported, module_running
from pipepar.meta.shapes import MetaShapes
from pipepar.meta.values import MetaScalars
from tests.program._data_models import batch, build


@pytest.mark.parametrize("shapes", [None, MetaShapes()], ids=["kernels", "remembered"])
def test_a_data_dependent_operation_on_known_values_takes_their_shape(
    shapes: MetaShapes | None,
) -> None:
    """Each time from the values: two masks of one shape give two shapes (none remembered)."""
    for mask, n in ((torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]]), 6), (torch.ones(2, 4), 8)):
        with MetaScalars(shapes) as values:
            meta = torch.empty_like(mask, device="meta")
            values.know(meta, mask)
            where = torch.nonzero(meta)
            kept = torch.arange(4, device="meta").expand(2, 4)[meta.bool()]
            assert where.is_meta and kept.is_meta
            assert tuple(where.shape) == (n, 2) and tuple(kept.shape) == (n,)
            assert int(where[-1, 1]) == 3  # its value is known too
    with pytest.raises(NotImplementedError):  # torch alone cannot say
        torch.nonzero(torch.empty(2, 4, device="meta"))


def test_a_kernel_stricter_on_meta_takes_the_shape_another_dtype_gives() -> None:
    x = torch.empty(12, 32, device="meta")
    w = torch.empty(4, 32, 16, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="BFloat16"):  # float32 refused on meta
        torch.nn.functional.grouped_mm(x, w, offs=offs)
    with MetaScalars():
        out = torch.nn.functional.grouped_mm(x, w, offs=offs)
    assert out.is_meta and out.shape == (12, 16) and out.dtype == torch.float32
    real = torch.nn.functional.grouped_mm(
        torch.randn(12, 32), torch.randn(4, 32, 16), offs=torch.tensor([3, 6, 9, 12]).int()
    )
    assert real.shape == out.shape and real.dtype == out.dtype


class _Router(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > 0)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity(), _Router()])

    def forward(self, x: torch.Tensor) -> Any:
        return [block(x) for block in self.blocks][-1]


def test_an_operation_on_an_activations_values_names_the_operation_and_the_module() -> None:
    activation = torch.empty(2, 4, device="meta")  # made outside: no value known
    with MetaScalars(), pytest.raises(MetaUnsupported) as caught:
        _Model()(activation)
    text = str(caught.value)
    assert "aten.nonzero" in text and "blocks.1 (_Router)" in text, text
    assert module_running() is None  # outside any module


def test_a_mixture_of_experts_is_planned_from_a_sample() -> None:
    """transformers' default experts (``grouped_mm``) profile on meta, and the planned pipe
    gives the plain model's loss."""
    pytest.importorskip("transformers")
    import pipepar

    expected = build("mixtral")(**batch()).loss
    pipe = pipepar.wrap(build("mixtral"), sample=batch(), devices=["cpu", "cpu"])
    assert pipe.layout is not None and pipe.layout.pp == 2
    assert abs(pipe.step(**batch()) - expected.item()) <= 1e-5 * expected.item()


def test_eager_experts_are_profiled_on_the_device_and_named_on_meta() -> None:
    """The eager experts loop over the experts ``nonzero`` picks from the router's choice: a
    profile on the CPU measures their split backwards there; one on meta ends naming the
    operation and the module."""
    pytest.importorskip("transformers")
    import pipepar

    model = build("mixtral", "eager")
    names = [layer.name for layer in pipepar.profile(model, batch(), device="cpu").layers]
    assert names == [u.path for u in pipepar.units(model, batch())]
    with pytest.raises(MetaUnsupported, match=r"aten\.nonzero.*experts \(MixtralExperts\)"):
        pipepar.profile(model, batch(), device="meta")
