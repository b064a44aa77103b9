"""A state a model keeps on itself, across two gloo ranks (:class:`~pipepar.program.ranks.RankCut`):
each rank runs the whole forward, its own stage for real and the other in shadow on meta, so
the state is a real tensor on one rank and a meta one on the other; both see it used by the next
micro-batch and refuse, under ``torch.no_grad()`` as with a detached state and grad on. A
constant kept on the model runs as the plain model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests._ranks import spawn
from tests.program.test_kept_state import _CellNet, _Recurrent, _Rotary

pytestmark = pytest.mark.slow


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().sum()


def _refusal(model: torch.nn.Module, grad: bool) -> str:
    """The first error of three calls of a two-rank pipe of ``model``, or ``"none"``."""
    import pipepar.distributed as ppd

    pipe = ppd.wrap(model, split=["b"], chunks=2, state_dict=copy.deepcopy(model.state_dict()))
    try:
        for _ in range(3):
            if grad:  # a training step (a rank cannot run pipe(...)'s backward)
                pipe.step(torch.randn(4, 4), loss_fn=_loss, target=torch.zeros(4, 4))
            else:
                with torch.no_grad():
                    pipe(torch.randn(4, 4))
        return "none"
    except Exception as err:  # every rank stops
        return f"{type(err).__name__}: {err}"
    finally:
        pipe.close()


def _two_ranks(rank: int) -> dict[str, Any]:
    import pipepar.distributed as ppd

    torch.manual_seed(0)
    out = {
        "no_grad": _refusal(_Recurrent(detach=False), grad=False),
        "detached": _refusal(_Recurrent(detach=True), grad=True),
        "within a stage": _refusal(_CellNet(), grad=False),
    }
    torch.manual_seed(0)
    model = _Rotary(keep_map=False)
    state = copy.deepcopy(model.state_dict())
    pipe = ppd.wrap(
        model, split=["b"], chunks=2, state_dict=state, batch_coupling="per-micro-batch"
    )
    torch.manual_seed(1)
    xs = [torch.randn(4, 4) for _ in range(3)]
    with torch.no_grad():
        out["rotary"] = [pipe(x) for x in xs]
    pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    return spawn(2, _two_ranks)


@pytest.mark.parametrize(
    ("case", "where"), [("no_grad", "state"), ("detached", "state"), ("within a stage", "b.state")]
)
def test_a_state_kept_on_the_model_is_refused_on_every_rank(
    ranks: dict[int, Any], case: str, where: str
) -> None:
    """The state is read on the rank that computes the stage reading it (real) and followed
    on the other (meta): each names it."""
    for rank in (0, 1):
        got = ranks[rank][case]
        assert f"'{where}' the model keeps on itself" in got, (rank, got)


def test_a_constant_kept_on_the_model_runs_as_the_plain_model_across_ranks(
    ranks: dict[int, Any],
) -> None:
    torch.manual_seed(0)
    plain = _Rotary(keep_map=False)
    torch.manual_seed(1)
    xs = [torch.randn(4, 4) for _ in range(3)]
    with torch.no_grad():
        for x, got in zip(xs, ranks[1]["rotary"]):
            want = torch.cat([plain(part) for part in x.chunk(2)])
            assert torch.allclose(got, want, atol=1e-6)
