"""A model in float64: the loss ``pipe.step`` returns keeps float64's precision, equal to the
plain model's to float64's rounding (it was rounded to float32, a relative error of about
1e-8), for any model and for an ``nn.Sequential``; a float32 model's loss stays float32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipepar


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=gen, dtype=dtype), torch.randn(
        8, 6, generator=gen, dtype=dtype
    )


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return nn.Sequential(*[m for _ in range(2) for m in (nn.Linear(6, 6), nn.Tanh())])
    return Net()


@pytest.mark.parametrize("kind", ["sequential", "any"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_returned_loss_keeps_the_models_precision(kind: str, dtype: torch.dtype) -> None:
    model = _model(kind).to(dtype)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    x, y = _batch(dtype)
    loss = pipe.step(x, loss_fn=F.mse_loss, target=y)
    expected = F.mse_loss(plain(x), y)
    assert torch.as_tensor(loss).dtype == dtype
    rtol = 1e-14 if dtype == torch.float64 else 1e-6
    assert abs(float(loss) - expected.item()) <= rtol * abs(expected.item()), (
        float(loss),
        expected.item(),
    )
