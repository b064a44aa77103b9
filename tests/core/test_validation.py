"""Every documented misuse of wrap() and of a pipe call gets a clear error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipepar
from pipepar.core.validation import check_checkpoint


def _model(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"balance": [2, 1]}, ValueError, r"sums to 3 but the model has 4 layers.*balance=None"),
        ({"balance": [2, 2, 0]}, ValueError, r"balance\[2\] is 0"),
        ({"balance": [3, -1, 2]}, ValueError, r"balance\[1\] is -1"),
        ({"balance": [2.0, 2]}, TypeError, r"balance\[0\] must be an int, but got 2.0"),
        ({"balance": [True, 3]}, TypeError, r"balance\[0\] must be an int"),
        ({"balance": "22"}, TypeError, r"balance must be a list of ints"),
        ({"balance": []}, ValueError, r"balance is empty"),
        ({"balance": [2, 2], "chunks": 0}, ValueError, r"chunks must be at least 1, but got 0"),
        ({"balance": [2, 2], "chunks": 2.5}, TypeError, r"chunks must be an int, but got 2.5"),
        (
            {"balance": [2, 2], "checkpoint": "sometimes"},
            ValueError,
            r"one of 'always'.*'sometimes'",
        ),
        (
            {"balance": [1, 1, 2], "devices": ["cpu", "cpu"]},
            ValueError,
            r"3 stages but only 2 devices",
        ),
        ({"balance": [2, 2], "devices": ["cpu", "tpu:9"]}, ValueError, r"'tpu:9'.*does not know"),
        ({"balance": [2, 2], "devices": "cpu"}, TypeError, r"devices must be a list"),
        ({"balance": [2, 2], "threads": 0}, ValueError, r"threads must be a positive int"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        pipepar.wrap(_model(), **kwargs)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(ValueError, match=r"'cuda:1' but CUDA is not available"):
        pipepar.wrap(_model(), [2, 2], devices=["cpu", "cuda:1"])


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"module must be an nn.Module, but got int"):
        pipepar.wrap(3, [1])  # type: ignore[arg-type]


def test_empty_model() -> None:
    with pytest.raises(ValueError, match=r"empty nn\.Sequential"):
        pipepar.wrap(nn.Sequential(), [1])


def test_same_layer_twice() -> None:
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"layer 2 is the same module object as layer 0.*deepcopy"):
        pipepar.wrap(nn.Sequential(layer, nn.ReLU(), layer), [2, 1])


def test_parameter_shared_between_stages() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b)
    with pytest.raises(
        ValueError, match=r"parameter 0.weight \(stage 0\) is shared with 2.weight \(stage 1\)"
    ):
        pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"])
    pipepar.wrap(model, [3], devices=["cpu"])  # within one stage sharing is fine


def test_balance_none_needs_sample() -> None:
    with pytest.raises(ValueError, match=r"no sample was given"):
        pipepar.wrap(_model(), None, devices=["cpu", "cpu"])


@pytest.mark.parametrize("bad", [[1, 2], "x", None, (torch.zeros(2, 4), 3)])
def test_non_tensor_input(bad: object) -> None:
    pipe = pipepar.wrap(_model(), [2, 2], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"input must be a Tensor or a tuple of Tensors"):
        pipe(bad)  # type: ignore[arg-type]


def test_layer_returning_non_tensor_names_the_layer() -> None:
    class ToList(nn.Module):
        def forward(self, x: torch.Tensor) -> list:
            return [x]

    pipe = pipepar.wrap(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), ToList()), [2, 1], devices=["cpu", "cpu"]
    )
    with pytest.raises(TypeError, match=r"output of layer 2 \(ToList\) must be a Tensor.*got list"):
        pipe(torch.randn(2, 4))


def test_inputs_with_different_batch_sizes() -> None:
    pipe = pipepar.wrap(nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"share a batch dimension 0.*\(3, 2\), \(4, 2\)"):
        pipe((torch.zeros(3, 2), torch.zeros(4, 2)))


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_checkpoint_is_taken_by_its_str_as_a_plain_str(mode: str) -> None:
    for given in (mode, _Text(mode)):
        got = check_checkpoint(given)
        assert got == mode and type(got) is str


@pytest.mark.parametrize(
    ("given", "shown"),
    [("sometimes", r"got 'sometimes';"), (None, r"got None;"), (_Text("no"), r"is 'no'\);")],
)
def test_checkpoint_of_no_mode_shows_what_was_given(given: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"checkpoint must be one of 'always'.*{shown}"):
        check_checkpoint(given)
