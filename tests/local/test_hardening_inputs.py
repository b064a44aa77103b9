"""Hostile inputs everywhere: the planner, the CLI and the engine answer clearly or carry them.

The argument checks of each entry point have their own tests (test_validation, test_partition,
test_plan, test_profile, test_units, test_cli); this file covers what those leave out: profiles
edited by hand, capacities spelled every way across every entry point, CLI arguments that used
to escape as tracebacks, and every kind of value the engine must carry between stages.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipepar
from pipepar.cli.main import main
from pipepar.core.recompute import is_recomputing

ROOT = Path(__file__).parents[2]
MODES = ["always", "except_last", "never"]


# -- partition ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "error", "match"),
    [
        (math.nan, ValueError, r"capacity=nan must be >= 0; use None or math\.inf for no"),
        ([5.0, math.nan], ValueError, r"capacity\[1\]=nan must be >= 0"),
        ("16GiB", TypeError, r"capacity must be a number.*got '16GiB'"),
        (True, TypeError, r"capacity must be a number.*got True"),
    ],
)
def test_partition_refuses_bad_capacities(
    capacity: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pipepar.partition([1, 2, 3], 2, capacity=capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, -0.5])
def test_partition_refuses_infinite_and_negative_costs(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"costs\[2\]={bad!r} must be finite and >= 0"):
        pipepar.partition([1, 2, bad, 4], 2)


def test_partition_capacity_smaller_than_any_item() -> None:
    with pytest.raises(ValueError, match=r"costs\[2\]=9 is larger than every capacity") as err:
        pipepar.partition([4, 5, 9, 1], 2, capacity=3)
    assert "short by 6" in str(err.value) and "raise the capacity" in str(err.value)


def test_partition_infinite_capacity_means_unlimited() -> None:
    assert pipepar.partition([1, 1, 1, 5], 2, capacity=math.inf) == [3, 1]


# -- profile and plan --------------------------------------------------------------------------


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh())


def _timed_profile() -> pipepar.Profile:
    return pipepar.profile(_model(), torch.randn(8, 16), device="cpu")


def _edit(prof: pipepar.Profile, layer: int, **changes: object) -> pipepar.Profile:
    layers = list(prof.layers)
    layers[layer] = dataclasses.replace(layers[layer], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(prof, layers=layers)


@pytest.mark.parametrize("field", ["forward_ms", "backward_ms"])
@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_plan_refuses_a_profile_with_bad_times(field: str, value: float) -> None:
    prof = _edit(_timed_profile(), 2, **{field: value})
    with pytest.raises(ValueError, match=rf"layer 2 \(Linear\) has {field}={value!r}") as err:
        pipepar.plan(prof, devices=2)
    assert "finite and >= 0" in str(err.value) and "re-profile" in str(err.value)


@pytest.mark.parametrize("field", ["params_bytes", "activation_bytes", "output_bytes"])
def test_plan_refuses_a_profile_with_negative_bytes(field: str) -> None:
    prof = _edit(pipepar.profile(_model(), torch.randn(8, 16)), 1, **{field: -4096})
    with pytest.raises(ValueError, match=rf"layer 1 \(ReLU\) has {field}=-4096"):
        pipepar.plan(prof, devices=2)


def test_plan_refuses_an_empty_profile() -> None:
    prof = dataclasses.replace(
        pipepar.profile(_model(), torch.randn(8, 16)), layers=[], storages=[], trained=[]
    )
    with pytest.raises(ValueError, match=r"the profile has no layers; profile a non-empty"):
        pipepar.plan(prof, devices=1)


def test_plan_with_unmeasured_times_plans_by_memory() -> None:
    prof = _edit(_timed_profile(), 0, forward_ms=None)
    assert pipepar.plan(prof, devices=2).objective == "memory"


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("1.5 TB", 1_500_000_000_000),
        ("512 mib", 512 * 2**20),
        (123456789, 123456789),
        (["1GiB", "2 GB"], [2**30, 2 * 10**9]),
    ],
)
def test_capacity_spellings_reach_the_plan(capacity: object, expected: object) -> None:
    p = pipepar.plan(_model(), torch.randn(8, 16), devices=2, capacity=capacity)  # type: ignore[arg-type]
    caps = [s.capacity_bytes for s in p.stages]
    assert caps == (expected if isinstance(expected, list) else [expected] * 2)


@pytest.mark.parametrize(
    ("capacity", "error", "match"),
    [
        ("abc", ValueError, r"capacity='abc' is not a byte size.*'16GiB'"),
        ("16 GiBs", ValueError, r"is not a byte size"),
        ("-2GiB", ValueError, r"must not be negative"),
        ("nan", ValueError, r"finite"),
        (["1GiB", "abc"], ValueError, r"capacity\[1\]='abc' is not a byte size"),
        (object(), TypeError, r"capacity must be a number of bytes or a string like '16GiB'"),
    ],
)
def test_bad_capacity_strings_everywhere(
    capacity: object, error: type[Exception], match: str
) -> None:
    x = torch.randn(8, 16)
    with pytest.raises(error, match=match):
        pipepar.plan(_model(), x, devices=2, capacity=capacity)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        pipepar.wrap(_model(), sample=x, devices=["cpu", "cpu"], capacity=capacity)


def test_capacity_smaller_than_any_layer_names_the_layer() -> None:
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"layer 0 \(Linear\) needs .* largest capacity is 1\.0"):
        pipepar.plan(_model(), x, devices=2, capacity="1KiB")
    with pytest.raises(ValueError, match=r"on a stage of its own .*\(short by"):
        pipepar.wrap(_model(), sample=x, devices=["cpu", "cpu"], capacity=1024)


def test_profile_names_the_layer_a_wrong_sample_breaks() -> None:
    for device in ("meta", "cpu"):
        with pytest.raises(ValueError, match=r"layer 0 \(Linear\) failed on an input of shape"):
            pipepar.profile(_model(), torch.randn(8, 15), device=device)
    with pytest.raises(ValueError, match=r"layer 0 \(Linear\) failed on an input of shape \(\)"):
        pipepar.profile(_model(), torch.tensor(1.0))


def test_empty_sample_batch_still_plans() -> None:
    p = pipepar.plan(_model(), torch.randn(0, 16), devices=2, chunks=4)
    assert sum(p.balance) == 4 and p.chunks == 1


# -- CLI ---------------------------------------------------------------------------------------

_MLP = ["profile", "models.mlp", "--model-kwargs", '{"depth": 2, "width": 64}']


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "models.nosuch", "--input-shape", "8,3"], "has no 'nosuch'"),
        (["profile", "nosuch_pkg:build", "--input-shape", "8,3"], "cannot import 'nosuch_pkg'"),
        (["profile", "os:getcwd", "--input-shape", "8,3"], "returned a str, not an nn.Module"),
        (["profile", "math:pi", "--input-shape", "8,3"], "is a float, not something to call"),
        (["profile", "", "--input-shape", "8,3"], "MODEL '' is empty"),
        (
            ["profile", "models.alexnet", "--input-shape", "8,3,8,8"],
            "layer 2 (MaxPool2d) failed on an input of shape (8, 64, 1, 1)",
        ),
        (
            ["profile", "models.alexnet", "--input-shape", "8,3"],
            "layer 0 (Conv2d) failed on an input of shape (8, 3)",
        ),
        ([*_MLP, "--input-shape", "8,63"], "layer 0 (Linear) failed on an input of shape (8, 63)"),
        ([*_MLP, "--input-shape", "0,64"], "--input-shape '0,64' must be positive ints"),
        ([*_MLP, "--input-shape", "8,,64"], "must be positive ints"),
        ([*_MLP, "--input-shape", "99999999999,99999999999"], "--input-shape"),
        ([*_MLP, "--input-shape", "8,64", "--capacity", "abc"], "--capacity='abc' is not a byte"),
        ([*_MLP, "--input-shape", "8,64", "--capacity", "1.5 XB"], "is not a byte size"),
        ([*_MLP, "--input-shape", "8,64", "--capacity", "16GiB,,"], "--capacity='' is not a"),
        ([*_MLP, "--input-shape", "8,64", "--capacity", "inf"], "--capacity must be a finite"),
        (
            [*_MLP, "--input-shape", "8,64", "--devices", "2", "--capacity", "1GiB,2GiB,3GiB"],
            "capacity has 3 entries but there are 2 devices",
        ),
        ([*_MLP, "--input-shape", "8,64", "--devices", ","], "devices is empty"),
        (
            [*_MLP, "--input-shape", "8,64", "--devices", "9"],
            "devices=9 asks for 9 stages but the model has 4 layers",
        ),
        ([*_MLP, "--input-shape", "8,64", "--profile-device", "bogus"], "--profile-device 'bogus'"),
        ([*_MLP, "--input-shape", "8,64", "--vocab", "-3"], "--vocab -3 must be at least 1"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_clear_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("pipepar: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cli_cuda_profile_device_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*_MLP, "--input-shape", "8,64", "--profile-device", "cuda:0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "CUDA is not available" in err


def test_cli_capacity_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    for text, expected in (("16GiB", [16 * 2**30] * 2), ("1.5 TB,512MB", [15 * 10**11, 512e6])):
        argv = [*_MLP, "--input-shape", "8,64", "--devices", "2", "--capacity", text]
        assert main([*argv, "--json", "-", "--quiet"]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["capacity_bytes"] == expected


def test_cli_process_exit_status_and_single_line() -> None:
    # The real process: no traceback may slip past main() to the interpreter.
    result = subprocess.run(
        [sys.executable, "-m", "pipepar", *_MLP, "--input-shape", "8,64", "--capacity", "lots"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("pipepar")]
    assert len(lines) == 1 and lines[0].startswith("pipepar: error: --capacity='lots' is not a")
    assert "Traceback" not in result.stderr


# -- the engine: values it must carry ------------------------------------------------------------

W = 6


def _compare(
    model: nn.Sequential, balance: list[int], x: object, *, chunks: int = 3, checkpoint: str
) -> None:
    """Outputs and every gradient (parameters, float inputs) equal the plain model's."""
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(
        model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint
    )
    x_pipe, x_plain = _clone_input(x), _clone_input(x)
    got, expected = pipe(x_pipe), plain(x_plain)
    got_t = got if isinstance(got, tuple) else (got,)
    expected_t = expected if isinstance(expected, tuple) else (expected,)
    assert [(t.dtype, t.shape) for t in got_t] == [(t.dtype, t.shape) for t in expected_t]
    for a, b in zip(got_t, expected_t):
        torch.testing.assert_close(a, b)
    _loss(got_t).backward()
    _loss(expected_t).backward()
    for (name, a), b in zip(pipe.named_parameters(), plain.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    for a, b in zip(_inputs(x_pipe), _inputs(x_plain)):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    pipe.close()


def _clone_input(x: object) -> object:
    def one(t: torch.Tensor) -> torch.Tensor:
        c = t.detach().clone() if t.is_contiguous() else t.detach()  # keep odd strides
        return c.requires_grad_(t.requires_grad)

    return tuple(one(t) for t in x) if isinstance(x, tuple) else one(x)  # type: ignore[arg-type]


def _inputs(x: object) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)  # type: ignore[return-value]


def _loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    floats = [t.double().square().sum() for t in outs if t.is_floating_point()]
    total = sum(floats, torch.zeros((), dtype=torch.float64))
    assert total.requires_grad
    return total


class Pair(nn.Module):
    """``(x, idx) -> (linear(x), idx)``: an integer tensor riding along a float one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, idx = pair
        return torch.tanh(self.lin(x)), idx


class Pick(nn.Module):
    """Uses the integer tensor: picks column ``idx`` of each row."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, idx = pair
        return x.gather(1, idx.unsqueeze(1))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, W)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(dim=1)


class WithMask(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x > 0


class ApplyMask(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = pair
        return x * mask


class Argmax(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.argmax(dim=1)


@pytest.mark.parametrize("checkpoint", MODES)
def test_integer_labels_ride_through_every_stage(checkpoint: str) -> None:
    x = (torch.randn(7, W), torch.randint(0, W, (7,)))
    _compare(nn.Sequential(Pair(), Pair(), Pair(), Pick()), [1, 1, 1, 1], x, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_integer_input_tokens(checkpoint: str) -> None:
    model = nn.Sequential(Embed(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 2))
    _compare(model, [1, 2, 1], torch.randint(0, 10, (7, 5)), checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_integer_and_float_outputs_together(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), Argmax())
    _compare(model, [2, 1], torch.randn(9, W), checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_boolean_masks_between_stages(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(W, W), WithMask(), nn.Identity(), ApplyMask())
    _compare(model, [1, 1, 1, 1], torch.randn(7, W), checkpoint=checkpoint)


def test_tuple_input_where_only_one_tensor_requires_grad() -> None:
    x = (torch.randn(7, W, requires_grad=True), torch.randint(0, W, (7,)))
    _compare(nn.Sequential(Pair(), Pick()), [1, 1], x, checkpoint="except_last")


@pytest.mark.parametrize("checkpoint", MODES)
def test_frozen_stages_still_pass_gradients(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
    model[1].requires_grad_(False)
    _compare(model, [1, 2, 1], torch.randn(8, W), checkpoint=checkpoint)


def test_fully_frozen_model_gives_input_gradients_only() -> None:
    model = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W)).requires_grad_(False)
    _compare(model, [1, 2], torch.randn(8, W, requires_grad=True), checkpoint="always")


def test_nothing_requires_grad_gives_a_plain_tensor() -> None:
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W)).requires_grad_(False)
    out = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=2)(torch.randn(4, W))
    assert not out.requires_grad and out.grad_fn is None


def test_stages_without_parameters() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Linear(W, W), nn.Tanh(), nn.Identity())
    _compare(model, [1, 1, 1, 1], torch.randn(8, W, requires_grad=True), checkpoint="always")


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(W, 8).t(),  # transposed
        lambda: torch.randn(8, 2 * W)[:, ::2],  # strided columns
        lambda: torch.randn(1, W).expand(8, W),  # stride 0 on the batch dimension
    ],
    ids=["transposed", "strided", "expanded"],
)
@pytest.mark.parametrize("checkpoint", MODES)
def test_non_contiguous_inputs(make: object, checkpoint: str) -> None:
    x = make()  # type: ignore[operator]
    assert not x.is_contiguous()
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W))
    model.append(nn.ReLU(inplace=True))
    _compare(model, [1, 3], x, checkpoint=checkpoint)


def test_channels_last_images_and_non_contiguous_stage_outputs() -> None:
    class Transposed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(2, 3)  # a view with other strides crosses the stage boundary

    model = nn.Sequential(nn.Conv2d(3, 4, 3), Transposed(), nn.ReLU(), nn.Conv2d(4, 2, 3))
    x = torch.randn(5, 3, 9, 8).to(memory_format=torch.channels_last)
    _compare(model, [2, 2], x, checkpoint="except_last")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("tuple_input", [False, True])
def test_empty_batches(checkpoint: str, tuple_input: bool) -> None:
    if tuple_input:
        model = nn.Sequential(Pair(), Pair(), Pick())
        x: object = (torch.randn(0, W), torch.zeros(0, dtype=torch.long))
    else:
        model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 3))
        x = torch.randn(0, W, requires_grad=True)
    _compare(model, [1, 1, 1], x, chunks=4, checkpoint=checkpoint)


def test_empty_batch_without_grad() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Linear(W, 3), nn.ReLU()), [1, 1], devices=["cpu"] * 2)
    with torch.no_grad():
        assert pipe(torch.randn(0, W)).shape == (0, 3)


class RecordRows(nn.Module):
    """Records the rows of each micro-batch its forward sees (not the recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_recomputing():
            self.rows.append(x.shape[0])
        return x


@pytest.mark.parametrize(
    ("batch", "chunks", "rows"),
    [
        (10, 4, [3, 3, 2, 2]),
        (13, 5, [3, 3, 3, 2, 2]),
        (7, 7, [1] * 7),
        (3, 8, [1, 1, 1]),  # fewer rows than chunks: one row each
        (3, 2**62, [1, 1, 1]),  # absurdly many chunks cost nothing
        (1, 1000, [1]),
    ],
)
def test_uneven_and_very_large_chunk_counts(batch: int, chunks: int, rows: list[int]) -> None:
    model = nn.Sequential(nn.Linear(W, W), RecordRows(), nn.Linear(W, W))
    x = torch.randn(batch, W)
    _compare(model, [2, 1], x, chunks=chunks, checkpoint="except_last")
    assert model[1].rows == rows


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.randn(4, W).to_sparse(), TypeError, r"input tensor 0 has layout torch\.sparse_coo"),
        (torch.tensor(1.0), ValueError, r"share a batch dimension 0, but got shapes \[\(\)\]"),
        ((), TypeError, r"must be a Tensor or a tuple of Tensors, but got tuple of \(empty\)"),
        ({"x": torch.randn(4, W)}, TypeError, r"but got dict"),
        ((torch.randn(4, W), [1]), TypeError, r"tuple of \(Tensor, list\)"),
    ],
    ids=["sparse", "scalar", "empty-tuple", "dict", "nested"],
)
def test_values_the_engine_refuses(bad: object, error: type[Exception], match: str) -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Linear(W, W), nn.ReLU()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(error, match=match):
        pipe(bad)  # type: ignore[arg-type]


def test_wrong_dtype_input_fails_in_the_layer_with_its_stage_named() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.ReLU(), nn.Linear(W, W)), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"dtype") as info:
        pipe(torch.randn(4, W, dtype=torch.float64))
    assert any("stage 1 (layers 1..1 on cpu), micro-batch 0" in n for n in info.value.__notes__)
