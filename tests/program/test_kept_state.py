"""A state a model keeps on itself between calls (:mod:`pipepar.program.kept_state`): through a
pipe each micro-batch is a call, so using the values of what another micro-batch (or an earlier
call) left there is refused, under ``torch.no_grad()`` and for a detached state too; what no
micro-batch's rows made (a rotary-like table), what is stored and never read back (attention
maps kept for inspection) and a state whose shape alone is read run as the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipepar


class _Recurrent(nn.Module):
    """Keeps its last output on itself and adds it in its next call (unless the batch size
    changed): a recurrent state, detached or not."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.detach = detach
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.state is None or self.state.shape[0] != x.shape[0]:
            self.state = torch.zeros_like(h)
        out = self.b(h + self.state)
        self.state = out.detach() if self.detach else out
        return out


class _Cell(nn.Module):
    """A layer keeping its last output, detached, on itself and adding it to its next input:
    the state is written and read within one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.state: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.state is not None and self.state.shape == h.shape:
            h = h + self.state
        out = self.linear(h)
        self.state = out.detach()
        return out


class _CellNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), _Cell()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _calls_until_refused(model: nn.Module, grad: bool, calls: int = 3) -> int | None:
    """The call (counting from 0) a two-stage pipe of ``model`` refused, or None."""
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    with torch.set_grad_enabled(grad):
        for call in range(calls):
            try:
                pipe(torch.randn(4, 4))
            except RuntimeError as refused:
                assert "'state' the model keeps on itself" in str(refused), refused
                assert "use_cache=False" in str(refused)
                return call
    return None


@pytest.mark.parametrize("seed", range(4))
def test_a_state_read_by_the_next_micro_batch_under_no_grad_is_refused(seed: int) -> None:
    """The threads decide whether the first call's micro-batch 1 reads micro-batch 0's state;
    the second call reads the first one's in any case, and runs under the cut's mode (the
    first left a state on the model: no route was learned)."""
    torch.manual_seed(seed)
    assert _calls_until_refused(_Recurrent(detach=False), grad=False) in (0, 1)


@pytest.mark.parametrize("seed", range(4))
def test_a_detached_state_read_with_grad_on_is_refused(seed: int) -> None:
    torch.manual_seed(seed)
    assert _calls_until_refused(_Recurrent(detach=True), grad=True) in (0, 1)


@pytest.mark.parametrize("grad", [False, True])
def test_a_state_a_layer_keeps_within_its_stage_is_refused_naming_it(grad: bool) -> None:
    torch.manual_seed(0)
    pipe = pipepar.wrap(_CellNet(), split=["b"], devices=["cpu", "cpu"], chunks=2)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"state 'b\.state'"):
        for _ in range(3):
            pipe(torch.randn(4, 4))


class _Rotary(nn.Module):
    """Caches a rotary-like table on itself in its first call (made from shapes only) and
    reuses it in later micro-batches and calls; optionally stores its attention map for
    inspection (never read back) and reads the shape of the last one."""

    def __init__(self, keep_map: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.keep_map = keep_map
        self.table: torch.Tensor | None = None
        self.attention_map: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.table is None:
            positions = torch.arange(x.shape[1], dtype=x.dtype)
            self.table = torch.cos(positions / 3) + torch.zeros_like(h[0])
        if self.attention_map is not None:
            assert self.attention_map.shape[-1] == h.shape[0]  # its shape only
        weights = torch.softmax(h @ h.T, dim=-1)
        if self.keep_map:
            self.attention_map = weights
        return self.b(weights @ h * self.table)


@pytest.mark.parametrize("keep_map", [False, True])
def test_constants_and_maps_kept_on_the_model_run_as_the_plain_model(keep_map: bool) -> None:
    """Each micro-batch's attention covers its own rows: the plain model is run per micro-batch
    (as ``batch_coupling="per-micro-batch"`` accepts) to compare."""
    torch.manual_seed(0)
    model = _Rotary(keep_map)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, [1, 1], devices=["cpu", "cpu"], chunks=2, batch_coupling="per-micro-batch"
    )
    routes = pipe._compute._routes  # type: ignore[attr-defined]
    learned = []
    for call in range(3):
        x = torch.randn(4, 4)
        with torch.no_grad():
            got = pipe(x)
            want = torch.cat([plain(part) for part in x.chunk(2)])
        assert torch.allclose(got, want, atol=1e-6), call
        learned.append(len(routes))
    # A constant kept on the model lets the next call follow a learned route (without the
    # mode). A map of the rows kept on it sends the next call under the mode too, where a read
    # of it would be seen; that call reads none, so the third follows a route.
    assert learned == ([0, 1, 1] if keep_map else [1, 1, 1])
    x = torch.randn(4, 4)
    pipe(x).square().sum().backward()
    torch.cat([plain(part) for part in x.chunk(2)]).square().sum().backward()
    for (name, got_p), want_p in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(got_p.grad, want_p.grad, atol=1e-6), name


class _ShapeOnly(nn.Module):
    """Keeps its last output, detached, and reads only its shape (to start afresh on a new
    batch size): each call computes from its own input alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        fresh = self.state is None or self.state.size(0) != x.size(0)
        out = self.b(h * 2 if fresh else h * 2 + torch.zeros_like(self.state))
        self.state = out.detach()
        return out


def test_reading_only_the_shape_of_a_kept_state_runs_as_the_plain_model() -> None:
    torch.manual_seed(0)
    model = _ShapeOnly()
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    for call in range(3):
        x = torch.randn(4, 4)
        with torch.no_grad():
            assert torch.allclose(pipe(x), plain(x), atol=1e-6), call


class _WeightTable(nn.Module):
    """Keeps a tensor made from its weights alone (no row's values) with its autograd history
    and uses it in the next call: not a state of the rows, but its gradient cannot reach the
    stage that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = self.b(h if self.kept is None else h + self.kept)
        self.kept = self.b.weight.sum(0) * 2
        return out


def test_a_kept_tensor_of_the_weights_with_history_is_still_refused_for_its_gradient() -> None:
    pipe = pipepar.wrap(_WeightTable(), [1, 1], devices=["cpu", "cpu"])
    pipe(torch.randn(3, 2))
    with pytest.raises(RuntimeError, match=r"not made by a torch operation of this call"):
        pipe(torch.randn(3, 2))


class _PythonBatchNorm(nn.BatchNorm1d):
    """A batch norm written in Python: its running statistics are buffers updated in place
    from each call's rows, saved with the weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean, var = x.mean(0), x.var(0, unbiased=False)
            with torch.no_grad():
                assert self.running_mean is not None and self.running_var is not None
                self.running_mean.mul_(1 - 0.1).add_(0.1 * mean)
                self.running_var.mul_(1 - 0.1).add_(0.1 * var)
        else:
            assert self.running_mean is not None and self.running_var is not None
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 8), _PythonBatchNorm(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def test_running_statistics_saved_with_the_weights_are_read_as_the_plain_model_reads_them() -> (
    None
):
    """Running statistics a model updates in place from its rows are its own state (saved in
    its ``state_dict``): evaluating after training reads them, through the pipe as in a plain
    call of the same model."""
    torch.manual_seed(0)
    model = _NormNet()
    pipe = pipepar.wrap(
        model, split=["b"], devices=["cpu", "cpu"], chunks=2, batch_coupling="per-micro-batch"
    )
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(2):
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        pipe.zero_grad()
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(pipe(x), model(x))
