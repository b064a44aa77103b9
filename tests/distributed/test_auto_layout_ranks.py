"""``pipepar.distributed.wrap(model, plan="auto", sample=x)`` on two gloo ranks: group rank 0
chooses the layout and every rank builds it; a step equals one plain process's on the global
batch; what is given is fixed; an error on rank 0 fails every rank instead of a hang."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipepar.distributed as ppd
from pipepar.planner.layout import Layout
from pipepar.planner.runtime_fit import RuntimeFit
from tests._ranks import spawn
from tests._small_models import Residual, tanh_stack

WORLD, ROWS, WIDTH = 2, 8, 6


def _sequential() -> nn.Sequential:
    return tanh_stack(WIDTH)


def _residual() -> nn.Module:
    return Residual(WIDTH, WIDTH)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _wide() -> nn.Sequential:
    """Activations of 128 KiB per micro-batch of 8 (offload sends them) on 2048 rows."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(128, 128), nn.GELU())])


def _wide_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2048, 128, generator=g), torch.randn(2048, 128, generator=g)


def _one_step(
    make: Any, *, meta: bool = False, batch: Any = _batch, **kwargs: Any
) -> dict[str, Any]:
    """Wrap by plan="auto" on this rank, step on this replica's rows of the global batch;
    the layout and the step's differences from the plain model."""
    import torch.distributed as dist

    x, y = batch()
    plain = make()
    if meta:
        with torch.device("meta"):
            model = make()
        kwargs["state_dict"] = plain.state_dict()
    else:
        model = make()
    pipe = ppd.wrap(model, plan="auto", sample=x, **kwargs)
    layout: Layout = pipe.layout  # type: ignore[assignment]
    replica = dist.get_rank() // layout.pp
    assert replica == pipe.dp_rank
    mine = slice(replica * layout.rows, (replica + 1) * layout.rows)
    if isinstance(model, nn.Sequential):
        loss = pipe.step(x[mine], y[mine], nn.functional.mse_loss)
    else:
        loss = pipe.step(x[mine], loss_fn=nn.functional.mse_loss, target=y[mine])
    ref = nn.functional.mse_loss(plain(x), y)
    ref.backward()
    grads = dict(plain.named_parameters())
    grad_error = max(
        (_whole(p.grad) - grads[name].grad).abs().max().item()
        for name, p in pipe.named_parameters()
    )
    pipe.close()
    return {
        "layout": layout.to_dict(),
        "pipe": (pipe.chunks, pipe.checkpoint, getattr(pipe.schedule, "name", pipe.schedule)),
        "dp_shard": pipe.dp_shard,
        "offload": pipe.offload,
        "loss_error": abs(float(loss) - ref.item()),
        "grad_error": grad_error,
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A gradient, gathered from its shards when the pipe shards its state."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _refused_everywhere(make: Any = _sequential, batch: Any = _batch, **kwargs: Any) -> str:
    """Nothing fits (1 KiB by default): rank 0's error, raised on every rank."""
    kwargs = {"capacity": "1KiB", **kwargs}
    try:
        ppd.wrap(make(), plan="auto", sample=batch()[0], **kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


OFFLOADED = {
    "dp": 1,
    "capacity": 4_500_000,
    "schedule": "gpipe",
    "chunks": 8,
    "checkpoint": "never",
}
"""5.7 MB per device without offload, 3.3 MB with it: only offload fits."""


def _cases(rank: int) -> dict[str, Any]:
    return {
        "free": _one_step(_sequential),
        "dp=2": _one_step(_sequential, dp=2, chunks=2),
        "sharded": _one_step(_sequential, dp_shard=True, chunks=2),
        "dp=1": _one_step(_sequential, dp=1, schedule="1f1b", checkpoint="always"),
        "meta": _one_step(_sequential, meta=True),
        "residual": _one_step(_residual, dp=1),
        "fitted": _one_step(_sequential, dp=1, runtime=RuntimeFit(action_ms=1e3)),
        # asked for: the CPU ranks' memory is the host's, so the search would not choose it
        "offload": _one_step(_wide, batch=_wide_batch, offload=True, **OFFLOADED),
        "refused": _refused_everywhere(),
        "not offloaded": _refused_everywhere(_wide, _wide_batch, **OFFLOADED),
    }


@pytest.mark.slow
def test_every_rank_builds_rank_0s_layout_and_a_step_equals_the_plain_model() -> None:
    got = spawn(WORLD, _cases, timeout=240)
    for case in ("free", "dp=2", "sharded", "dp=1", "meta", "residual", "fitted", "offload"):
        first = got[0][case]
        layout = first["layout"]
        assert all(got[r][case]["layout"] == layout for r in got), case  # all ranks agree
        rows = 2048 if case == "offload" else ROWS
        assert layout["pp"] * layout["dp"] == WORLD and layout["rows"] * layout["dp"] == rows
        assert sum(layout["balance"]) == (8 if case != "residual" else 5), case
        assert first["pipe"] == (layout["chunks"], layout["checkpoint"], layout["schedule"])
        assert first["dp_shard"] == layout["dp_shard"], case
        assert all(got[r][case]["offload"] == layout["offload"] for r in got), case
        for r in got:
            assert got[r][case]["loss_error"] < 1e-5, (case, r)
            assert got[r][case]["grad_error"] < 1e-5, (case, r)
    assert (got[0]["dp=2"]["layout"]["dp"], got[0]["dp=2"]["layout"]["chunks"]) == (2, 2)
    fixed = got[0]["dp=1"]["layout"]
    assert (fixed["dp"], fixed["schedule"], fixed["checkpoint"]) == (1, "1f1b", "always")
    assert got[0]["residual"]["layout"]["dp"] == 1
    assert got[0]["offload"]["layout"]["offload"]  # as asked
    assert not any(got[0][case]["layout"]["offload"] for case in ("free", "dp=1", "fitted"))
    fitted = got[0]["fitted"]["layout"]  # a second per action: as few micro-batches as can be
    assert fitted["chunks"] == 1 and fitted["step_ms"] > 2e3
    sharded = got[0]["sharded"]["layout"]  # dp_shard=True: only sharded layouts, so dp=2
    assert (sharded["dp"], sharded["dp_shard"]) == (2, True)
    assert got[0]["refused"].startswith("no layout fits 2 devices of 1.0 KiB")
    assert got[1]["refused"].startswith("group rank 0, which chooses the layout for every")
    assert "no layout fits" in got[1]["refused"]
    for r in got:  # offload unset on CPU ranks: never chosen, so nothing fits 4.5 MB
        assert "no layout fits" in got[r]["not offloaded"], r
        assert "offload is not tried" in got[r]["not offloaded"], r


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, r"plan='auto' needs sample=<one step's global batch>"),
        ({"plan": "magic"}, ValueError, r"plan='magic' is not known; pass plan='auto'"),
        ({"plan": 1}, TypeError, r"plan must be 'auto' or None, got int 1"),
        ({"balance": [4, 4]}, ValueError, r"balance=\[4, 4\] was given too; drop balance="),
        ({"split": ["2"]}, ValueError, r"split=\['2'\] was given too; drop split="),
        ({"dp_shard": "yes"}, TypeError, r"dp_shard must be True, False or None"),
        ({"schedule": "zigzag"}, ValueError, r"schedule='zigzag' is not one of"),
        ({"dp": 0}, ValueError, r"dp=0 must be an int >= 1"),
    ],
)
def test_bad_arguments_fail_before_any_communication(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """No process group here: each check comes first, on every rank alike."""
    sample = None if not kwargs else torch.randn(ROWS, WIDTH)
    with pytest.raises(error, match=match):
        ppd.wrap(_sequential(), **({"plan": "auto", "sample": sample} | kwargs))
