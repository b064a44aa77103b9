"""pipepar.GPipe is a drop-in for torchgpipe.GPipe: same script, results, attributes and errors."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Any

import pytest
import torch
import torchgpipe
from torch import nn

import pipepar
import pipepar.gpipe
from pipepar.core.stage import split_stages

CPU2 = ["cpu", "cpu"]

# A training script as written for torchgpipe; only its first line changes.
SCRIPT = """
{import_line}
import torch.nn.functional as F

model = GPipe(model, balance=[3, 2], devices=devices, chunks=4, checkpoint=checkpoint,
              deferred_batch_norm=deferred_batch_norm)
in_device, out_device = model.devices[0], model.devices[-1]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
outputs, input_grads = [], []
for input, target in batches:
    input = input.to(in_device).requires_grad_()
    target = target.to(out_device, non_blocking=True)
    output = model(input)
    loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    outputs.append(output.detach())
    input_grads.append(input.grad)
attributes = (model.balance, model.devices, model.chunks, model.checkpoint,
              len(model.partitions), len(model))
layers = list(model)
"""

TORCHGPIPE = "from torchgpipe import GPipe"
PIPEPAR = "from pipepar import GPipe"


def _model(batch_norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8) if batch_norm else nn.Tanh()
    return nn.Sequential(
        nn.Linear(6, 8), norm, nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3)
    ).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,))) for _ in range(n)]


def _run_script(
    import_line: str,
    checkpoint: str = "except_last",
    *,
    batch_norm: bool = True,
    deferred_batch_norm: bool = False,
    steps: int = 3,
) -> dict[str, Any]:
    scope: dict[str, Any] = {
        "model": _model(batch_norm),
        "devices": CPU2,
        "checkpoint": checkpoint,
        "deferred_batch_norm": deferred_batch_norm,
        "batches": _batches(steps),
        "torch": torch,
    }
    exec(SCRIPT.format(import_line=import_line), scope)
    return scope


def _run_plain(*, batch_norm: bool, steps: int = 3) -> dict[str, Any]:
    """The script's loop on the plain model."""
    model = _model(batch_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outputs, input_grads = [], []
    for input, target in _batches(steps):
        input = input.requires_grad_()
        output = model(input)
        optimizer.zero_grad()
        nn.functional.cross_entropy(output, target).backward()
        optimizer.step()
        outputs.append(output.detach())
        input_grads.append(input.grad)
    return {"outputs": outputs, "input_grads": input_grads, "layers": list(model)}


def _assert_same_training(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Outputs, input gradients, parameters and their gradients agree."""
    close = {"atol": 1e-10, "rtol": 1e-10}
    for key in ("outputs", "input_grads"):
        for a, b in zip(got[key], expected[key], strict=True):
            torch.testing.assert_close(a, b, **close)
    for a, b in zip(got["layers"], expected["layers"], strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p, q, **close, msg=name)
            torch.testing.assert_close(p.grad, q.grad, **close, msg=f"grad of {name}")


def _assert_same_buffers(got: dict[str, Any], expected: dict[str, Any]) -> None:
    # Batch-norm statistics are summed in another order: float64 noise, not 1e-10.
    for a, b in zip(got["layers"], expected["layers"], strict=True):
        for s, t in zip(a.buffers(), b.buffers(), strict=True):
            torch.testing.assert_close(s, t, atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_script_matches_torchgpipe_and_plain_model_by_changing_the_import(checkpoint: str) -> None:
    ours = _run_script(PIPEPAR, checkpoint, batch_norm=False)
    theirs = _run_script(TORCHGPIPE, checkpoint, batch_norm=False)
    assert isinstance(ours["model"], pipepar.GPipe)
    torch_devices = [torch.device("cpu")] * 2
    assert (
        ours["attributes"] == theirs["attributes"] == ([3, 2], torch_devices, 4, checkpoint, 2, 5)
    )
    _assert_same_training(ours, theirs)
    _assert_same_training(ours, _run_plain(batch_norm=False))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_script_with_batch_norm_matches_torchgpipe(checkpoint: str) -> None:
    # Each micro-batch is normalised by its own statistics (so not like the plain model).
    ours = _run_script(PIPEPAR, checkpoint)
    theirs = _run_script(TORCHGPIPE, checkpoint)
    _assert_same_training(ours, theirs)
    # On purpose, a recomputed forward does not update the running statistics a second time
    # (torchgpipe's does): they are the same whatever is recomputed, and torchgpipe's without
    # recompute.
    _assert_same_buffers(ours, _run_script(TORCHGPIPE, "never"))


def test_deferred_batch_norm_matches_torchgpipe_and_the_plain_models_statistics() -> None:
    ours = _run_script(PIPEPAR, deferred_batch_norm=True)
    theirs = _run_script(TORCHGPIPE, deferred_batch_norm=True)
    _assert_same_training(ours, theirs)
    norms = [run["layers"][1] for run in (ours, theirs)]
    torch.testing.assert_close(norms[0].running_mean, norms[1].running_mean)
    assert norms[0].num_batches_tracked == norms[1].num_batches_tracked
    # After one step the running statistics are the whole batch's, as in the plain model. On
    # purpose, that includes the unbiased running_var (torchgpipe keeps the biased one).
    one_step = _run_script(PIPEPAR, deferred_batch_norm=True, steps=1)
    _assert_same_buffers(one_step, _run_plain(batch_norm=True, steps=1))


def test_sequential_look_matches_torchgpipe() -> None:
    ours = pipepar.GPipe(_model(), [3, 2], devices=CPU2)
    theirs = torchgpipe.GPipe(_model(), [3, 2], devices=CPU2)
    assert len(ours) == len(theirs) == 5
    for index in (0, 2, 3, -1, -5):
        assert type(ours[index]) is type(theirs[index])
    assert [type(m) for m in ours] == [type(m) for m in theirs]
    assert [len(p) for p in ours.partitions] == [len(p) for p in theirs.partitions]


def test_state_dict_keys_are_the_plain_models() -> None:
    plain = _model()
    pipe = pipepar.GPipe(copy.deepcopy(plain), [3, 2], devices=CPU2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert "partitions" not in dict(pipe.named_children())
    pipe.load_state_dict(plain.state_dict())


def _hook_calls(make: Callable[..., nn.Module]) -> list[int]:
    """How often forward hooks on ``partitions[0]`` and ``[1]`` fire in a training step and
    a no-grad forward."""
    pipe = make(_model(), [3, 2], devices=CPU2, chunks=3)
    assert isinstance(pipe.partitions, nn.ModuleList)
    calls = [0, 0]
    for j, partition in enumerate(pipe.partitions):
        partition.register_forward_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    x = torch.randn(9, 6, dtype=torch.float64)
    pipe(x).sum().backward()  # forwards of 3 micro-batches, then 2 recomputed
    with torch.no_grad():
        pipe(x)
    return calls


def test_forward_hooks_on_partitions_fire_as_under_torchgpipe() -> None:
    assert _hook_calls(pipepar.GPipe) == _hook_calls(torchgpipe.GPipe) == [8, 8]


def test_partitions_hold_the_models_layers() -> None:
    model = _model()
    pipe = pipepar.GPipe(model, [3, 2], devices=CPU2)
    assert [list(p) for p in pipe.partitions] == [list(model)[:3], list(model)[3:]]


def test_partitions_keep_the_models_layer_names() -> None:
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(4, 4), act=nn.ReLU(), fc2=nn.Linear(4, 2)))
    ours = pipepar.GPipe(model, [2, 1], devices=CPU2)
    theirs = torchgpipe.GPipe(copy.deepcopy(model), [2, 1], devices=CPU2)
    assert [list(dict(p.named_children())) for p in ours.partitions] == [["fc1", "act"], ["fc2"]]
    assert [list(dict(p.named_children())) for p in theirs.partitions] == [["fc1", "act"], ["fc2"]]


def test_stage_modules_keep_the_names_they_are_given() -> None:
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(4, 4), act=nn.ReLU(), fc2=nn.Linear(4, 2)))
    names = [name for name, _ in model.named_children()]
    stages = split_stages(list(model), [2, 1], [torch.device("cpu")] * 2, names=names)
    assert [list(dict(s.module.named_children())) for s in stages] == [["fc1", "act"], ["fc2"]]
    assert stages[0].module.fc1 is model.fc1
    default = split_stages(list(model), [2, 1], [torch.device("cpu")] * 2)
    assert [list(dict(s.module.named_children())) for s in default] == [["0", "1"], ["2"]]


# -- mistakes: the same exception type as torchgpipe ----------------------------------------------
def _three_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _twice_the_same_layer() -> nn.Sequential:
    layer = nn.Linear(4, 4)
    return nn.Sequential(layer, nn.ReLU(), layer)


def _tied_across_stages() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    return model


# (mistake, model, arguments, a word pipepar's message must name)
MISTAKES: list[tuple[str, Callable[[], Any], dict[str, Any], str]] = [
    ("module is a list", lambda: list(_three_layers()), {}, "module"),
    ("module is one layer", lambda: nn.Linear(4, 4), {}, "module"),
    ("balance is None", _three_layers, {"balance": None}, "balance"),
    ("balance sums too low", _three_layers, {"balance": [1, 1]}, "balance"),
    ("balance has a zero", _three_layers, {"balance": [0, 3]}, "balance"),
    ("balance is negative", _three_layers, {"balance": [-1, 4]}, "balance"),
    ("balance is an int", _three_layers, {"balance": 3}, "balance"),
    ("balance of strings", _three_layers, {"balance": ["2", "1"]}, "balance"),
    ("balance is empty", _three_layers, {"balance": []}, "balance"),
    ("chunks is 0", _three_layers, {"chunks": 0}, "chunks"),
    ("chunks is negative", _three_layers, {"chunks": -2}, "chunks"),
    ("chunks is a word", _three_layers, {"chunks": "many"}, "chunks"),
    ("chunks is None", _three_layers, {"chunks": None}, "chunks"),
    ("checkpoint unknown", _three_layers, {"checkpoint": "sometimes"}, "checkpoint"),
    ("checkpoint is None", _three_layers, {"checkpoint": None}, "checkpoint"),
    ("too few devices", _three_layers, {"devices": ["cpu"]}, "devices"),
    ("no devices", _three_layers, {"devices": []}, "devices"),
    ("unknown device name", _three_layers, {"devices": ["nowhere", "cpu"]}, "nowhere"),
    ("device of a wrong type", _three_layers, {"devices": [1.5, "cpu"]}, "devices"),
    ("devices is one string", _three_layers, {"devices": "cpu"}, "devices"),
    ("devices is one device", _three_layers, {"devices": torch.device("cpu")}, "devices"),
    ("the same layer twice", _twice_the_same_layer, {}, "layer 2"),
    ("weights tied across stages", _tied_across_stages, {}, "shared"),
]
if not torch.cuda.is_available():
    MISTAKES.append(("CUDA without CUDA", _three_layers, {"devices": ["cuda:0", "cpu"]}, "CUDA"))


def _error(make: Callable[..., Any], model: Any, arguments: dict[str, Any]) -> BaseException:
    arguments = {"balance": [2, 1], "devices": CPU2} | arguments
    balance = arguments.pop("balance")
    with pytest.raises(Exception) as info:
        make(model, balance, **arguments)
    return info.value


@pytest.mark.parametrize(
    ("model", "arguments", "named"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES]
)
def test_each_mistake_raises_torchgpipes_exception_type(
    model: Callable[[], Any], arguments: dict[str, Any], named: str
) -> None:
    theirs = _error(torchgpipe.GPipe, model(), arguments)
    ours = _error(pipepar.GPipe, model(), arguments)
    assert isinstance(ours, type(theirs)), f"torchgpipe: {theirs!r}; pipepar: {ours!r}"
    assert named in str(ours)


MOVES: list[tuple[str, Callable[[nn.Module], Any]]] = [
    ("to(device)", lambda pipe: pipe.to(torch.device("cpu"))),
    ("to(name)", lambda pipe: pipe.to("cpu")),
    ("to(device=)", lambda pipe: pipe.to(device="cpu")),
    ("to(tensor)", lambda pipe: pipe.to(torch.zeros(1))),
    ("to(name, dtype)", lambda pipe: pipe.to("cpu", torch.float64)),
    ("cuda()", lambda pipe: pipe.cuda()),
    ("cpu()", lambda pipe: pipe.cpu()),
]


@pytest.mark.parametrize("move", [m[1] for m in MOVES], ids=[m[0] for m in MOVES])
def test_moving_the_pipe_raises_type_error_like_torchgpipe(
    move: Callable[[nn.Module], Any],
) -> None:
    for make in (torchgpipe.GPipe, pipepar.GPipe):
        with pytest.raises(TypeError, match=None if make is torchgpipe.GPipe else "devices="):
            move(make(_three_layers(), [2, 1], devices=CPU2))


def test_changing_dtype_is_allowed() -> None:
    pipe = pipepar.GPipe(_three_layers(), [2, 1], devices=CPU2)
    assert pipe.to(torch.float64) is pipe
    assert pipe(torch.randn(3, 4, dtype=torch.float64)).dtype == torch.float64


# -- what torchgpipe accepts ---------------------------------------------------------------------
def test_whole_float_chunks_are_taken_as_int() -> None:
    pipe = pipepar.GPipe(_three_layers(), [2, 1], devices=CPU2, chunks=42.0)  # type: ignore[arg-type]
    assert pipe.chunks == 42 and type(pipe.chunks) is int
    assert pipe(torch.randn(84, 4)).shape == (84, 2)


def test_fractional_chunks_are_refused() -> None:
    # torchgpipe silently takes chunks=1.5 as 1; pipepar says so.
    with pytest.raises(ValueError, match=r"chunks must be a whole number, but got 1\.5"):
        pipepar.GPipe(_three_layers(), [2, 1], devices=CPU2, chunks=1.5)  # type: ignore[arg-type]


def test_balance_may_be_any_iterable_of_whole_numbers() -> None:
    pipe = pipepar.GPipe(_three_layers(), (n for n in [2.0, 1.0]), devices=CPU2)  # type: ignore[misc]
    assert pipe.balance == [2, 1]


@pytest.mark.parametrize("devices", [None, ["cpu"]])
def test_empty_sequential_is_the_identity_as_in_torchgpipe(devices: list[str] | None) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    for make in (torchgpipe.GPipe, pipepar.GPipe):
        pipe = make(nn.Sequential(), [], devices=devices, chunks=2)
        assert pipe(x) is x
        assert (pipe.balance, pipe.devices, len(pipe), list(pipe)) == ([], [], 0, [])
        assert isinstance(pipe.partitions, nn.ModuleList) and len(pipe.partitions) == 0
        with pytest.raises(TypeError):
            pipe("not a tensor")
    assert pipe.state_dict() == {} and list(pipe.children()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is every CUDA device there")
def test_default_devices_without_cuda_are_the_cpu() -> None:
    # torchgpipe finds no device here (IndexError); pipepar runs every partition on the CPU.
    with pytest.raises(IndexError):
        torchgpipe.GPipe(_three_layers(), [2, 1])
    pipe = pipepar.GPipe(_three_layers(), [2, 1], chunks=2)
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe(torch.randn(4, 4)).shape == (4, 2)


# -- checkpoint= as torchgpipe takes it: str(checkpoint) -------------------------------------------
class _Mode:
    """Not a str, but its str() is a mode: torchgpipe takes ``str(checkpoint)``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class _StrMode(str, Enum):
    ALWAYS = "always"


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_checkpoint_may_be_any_object_whose_str_is_a_mode(checkpoint: str) -> None:
    ours = _run_script(PIPEPAR, _Mode(checkpoint), batch_norm=False)  # type: ignore[arg-type]
    theirs = _run_script(TORCHGPIPE, _Mode(checkpoint), batch_norm=False)  # type: ignore[arg-type]
    assert ours["attributes"] == theirs["attributes"]
    assert type(ours["model"].checkpoint) is str and ours["model"].checkpoint == checkpoint
    _assert_same_training(ours, theirs)
    _assert_same_training(ours, _run_script(PIPEPAR, checkpoint, batch_norm=False))


def test_checkpoint_object_of_no_mode_is_refused_as_by_torchgpipe() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        torchgpipe.GPipe(_three_layers(), [2, 1], devices=CPU2, checkpoint=_Mode("sometimes"))
    with pytest.raises(
        ValueError, match=r"checkpoint must be one of .*whose str\(\) is 'sometimes'"
    ):
        pipepar.GPipe(_three_layers(), [2, 1], devices=CPU2, checkpoint=_Mode("sometimes"))  # type: ignore[arg-type]


def test_str_enum_checkpoint_is_kept_as_its_plain_mode() -> None:
    # Equal to "always", though its str() is "_StrMode.ALWAYS" on Python 3.11.
    pipe = pipepar.GPipe(_three_layers(), [2, 1], devices=CPU2, checkpoint=_StrMode.ALWAYS)
    assert type(pipe.checkpoint) is str and pipe.checkpoint == "always"


def test_wrap_takes_the_same_checkpoint_objects() -> None:
    pipe = pipepar.wrap(_three_layers(), [2, 1], devices=CPU2, checkpoint=_Mode("never"))  # type: ignore[arg-type]
    assert type(pipe.checkpoint) is str and pipe.checkpoint == "never"
    planned = pipepar.wrap(
        _three_layers(),
        devices=2,
        sample=torch.randn(4, 4),
        checkpoint=_Mode("always"),  # type: ignore[arg-type]
    )
    assert planned.checkpoint == "always" and sum(planned.balance) == 3
    with pytest.raises(ValueError, match="whose str"):
        pipepar.wrap(_three_layers(), [2, 1], devices=CPU2, checkpoint=_Mode("no"))  # type: ignore[arg-type]


# -- torchgpipe's checkpoints: partitions.<j>.<name>... ------------------------------------------
def _trained_torchgpipe(**options: Any) -> torchgpipe.GPipe:
    """A torchgpipe GPipe after two training steps (batch-norm statistics are not the init's)."""
    gpipe = torchgpipe.GPipe(_model(), [3, 2], devices=CPU2, chunks=3, **options)
    for x, y in _batches(2):
        nn.functional.cross_entropy(gpipe(x), y).backward()
        with torch.no_grad():
            for p in gpipe.parameters():
                p -= 0.1 * p.grad
    return gpipe


def _other_init() -> nn.Sequential:
    torch.manual_seed(123)
    norm = nn.BatchNorm1d(8)
    return nn.Sequential(
        nn.Linear(6, 8), norm, nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3)
    ).double()


def _assert_same_outputs(ours: nn.Module, theirs: nn.Module) -> None:
    x = torch.randn(12, 6, dtype=torch.float64)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
    # Training: each micro-batch normalised by its own statistics, summed in another order.
    ours.train(), theirs.train()
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-10, rtol=1e-10)


def test_torchgpipe_keys_are_its_partitions_with_the_models_layer_names() -> None:
    keys = list(_trained_torchgpipe().state_dict())
    assert keys[:2] == ["partitions.0.0.weight", "partitions.0.0.bias"]
    assert "partitions.1.3.weight" in keys and "partitions.1.4.bias" in keys


@pytest.mark.parametrize("deferred_batch_norm", [False, True])
@pytest.mark.parametrize("balance", [[3, 2], [1, 4], [5]])
def test_torchgpipe_checkpoint_loads_and_gives_identical_outputs(
    balance: list[int], deferred_batch_norm: bool
) -> None:
    theirs = _trained_torchgpipe(deferred_batch_norm=deferred_batch_norm)
    ours = pipepar.GPipe(
        _other_init(),
        balance,
        devices=["cpu"] * len(balance),
        chunks=3,
        deferred_batch_norm=deferred_batch_norm,
    )
    assert ours.load_state_dict(theirs.state_dict()) == ([], [])  # strict, nothing left over
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs.state_dict()[f"partitions.{_part(name)}.{name}"]), name
    _assert_same_outputs(ours, theirs)


def _part(name: str) -> int:
    """torchgpipe's partition of layer ``name`` under balance [3, 2]."""
    return int(int(name.split(".")[0]) >= 3)


def test_torchgpipe_checkpoint_file_converts_for_the_plain_model(tmp_path: Any) -> None:
    theirs = _trained_torchgpipe(deferred_batch_norm=True)  # with sum and sum_squares buffers
    torch.save(theirs.state_dict(), tmp_path / "gpipe.pt")
    state = pipepar.gpipe.from_torchgpipe_state_dict(torch.load(tmp_path / "gpipe.pt"))
    plain = _other_init()
    assert list(state) == list(plain.state_dict())
    assert set(state._metadata) == {"", "0", "1", "2", "3", "4"}  # type: ignore[attr-defined]
    plain.load_state_dict(state)
    plain.eval(), theirs.eval()
    x = torch.randn(12, 6, dtype=torch.float64)
    torch.testing.assert_close(plain(x), theirs(x), atol=0, rtol=0)


class _Classifier(nn.Module):
    """A model holding a pipe as a child: its keys are under ``body.``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def test_torchgpipe_checkpoint_loads_into_a_pipe_inside_another_model() -> None:
    theirs = _Classifier(_trained_torchgpipe())
    assert "body.partitions.1.4.weight" in theirs.state_dict()
    ours = _Classifier(pipepar.GPipe(_other_init(), [2, 3], devices=CPU2, chunks=3))
    ours.load_state_dict(theirs.state_dict())
    _assert_same_outputs(ours, theirs)


@pytest.mark.parametrize("prefix", ["", "body."])
def test_strict_loading_still_reports_wrong_keys(prefix: str) -> None:
    state = {prefix + k: v for k, v in _trained_torchgpipe().state_dict().items()}
    del state[prefix + "partitions.0.1.running_var"]
    state[prefix + "partitions.1.7.weight"] = torch.zeros(3)  # no layer 7
    pipe = pipepar.GPipe(_other_init(), [3, 2], devices=CPU2)
    model = _Classifier(pipe) if prefix else pipe
    if prefix:
        state["scale"] = torch.ones(3)
    with pytest.raises(RuntimeError, match="Missing key") as info:
        model.load_state_dict(state)
    assert f'"{prefix}1.running_var"' in str(info.value)
    assert f'Unexpected key(s) in state_dict: "{prefix}partitions.1.7.weight"' in str(info.value)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == [f"{prefix}1.running_var"]
    assert result.unexpected_keys == [f"{prefix}partitions.1.7.weight"]


def test_a_tensor_under_both_keys_is_refused() -> None:
    state = _trained_torchgpipe().state_dict()
    state["0.weight"] = state["partitions.0.0.weight"]
    pipe = pipepar.GPipe(_other_init(), [3, 2], devices=CPU2)
    with pytest.raises(ValueError, match=r"both '0\.weight' and .*'partitions\.0\.0\.weight'"):
        pipe.load_state_dict(state)


def test_a_layer_called_partitions_keeps_its_keys() -> None:
    model = nn.Sequential(
        OrderedDict(partitions=nn.Sequential(nn.Linear(4, 4), nn.ReLU()), head=nn.Linear(4, 2))
    )
    plain = copy.deepcopy(model)
    pipe = pipepar.GPipe(model, [1, 1], devices=CPU2)
    assert "partitions.0.weight" in pipe.state_dict()
    with torch.no_grad():
        plain.partitions[0].weight.add_(1.0)
    pipe.load_state_dict(plain.state_dict())
    assert torch.equal(pipe[0][0].weight, plain.partitions[0].weight)
