"""GradMode: the grad mode inside a block, the one before it after (as torch.set_grad_enabled)."""

import pytest
import torch

from pipepar.core.grad_mode import GradMode


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("inner", [True, False])
def test_sets_the_mode_and_puts_the_outer_one_back(outer: bool, inner: bool) -> None:
    with torch.set_grad_enabled(outer):
        with GradMode(inner):
            assert torch.is_grad_enabled() is inner
            y = torch.ones(1, requires_grad=True) * 2
        assert torch.is_grad_enabled() is outer
    assert y.requires_grad is inner


def test_puts_the_mode_back_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), GradMode(False):
        raise RuntimeError("boom")
    assert torch.is_grad_enabled()
