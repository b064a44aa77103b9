"""examples/alexnet_split.py runs in-process: progress, report lines, a falling loss."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import models

_PATH = Path(__file__).resolve().parents[2] / "examples" / "alexnet_split.py"
# Tiny but real: 64 px is about AlexNet's smallest input; a narrow classifier keeps it fast.
_FAST = ["--batch-size", "8", "--hidden", "64", "--chunks", "2", "--batches", "1"]


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("alexnet_split", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run(example: ModuleType, *argv: str) -> str:
    out = io.StringIO()
    assert example.main(list(argv), out=out) == 0
    return out.getvalue()


def _losses(text: str) -> tuple[float, float]:
    match = re.search(r"^loss: ([\d.]+) -> ([\d.]+) over \d+ steps$", text, re.MULTILINE)
    assert match, text
    return float(match[1]), float(match[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="default devices are the GPUs")
def test_defaults_split_over_two_cpu_stages_and_loss_falls(example: ModuleType) -> None:
    text = _run(example, "--steps", "6", *_FAST)
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 6 and steps[-1].startswith("step    6/6 [" + "#" * 24 + "]")
    balance = json.loads(re.search(r"^balance: (\[.*\])$", text, re.MULTILINE)[1])  # type: ignore[index]
    assert len(balance) == 2 and sum(balance) == len(models.alexnet(device="meta"))
    assert re.search(rf"^stage 0: cpu  layers 0-{balance[0] - 1}  \(Conv2d", text, re.MULTILINE)
    assert re.search(rf"^stage 1: cpu  layers {balance[0]}-21  \(", text, re.MULTILINE)
    rate = re.search(r"^throughput: ([\d.]+) samples/s \(steps 2-6\)$", text, re.MULTILINE)
    assert rate and float(rate[1]) > 0
    first, last = _losses(text)
    assert last < first


def test_flags_set_balance_devices_and_checkpoint(example: ModuleType) -> None:
    text = _run(
        example, "--steps", "2", "--devices", "cpu,cpu,cpu", "--balance", "8,8,8",
        "--checkpoint", "never", "--original", *_FAST,
    )  # fmt: skip
    assert "balance: [8, 8, 8]" in text
    assert "stage 2: cpu  layers 16-23" in text
    assert "chunks: 2  checkpoint: never" in text
    assert "(2012, two-GPU)" in text


def test_default_balance_cuts_only_before_weighted_layers(example: ModuleType) -> None:
    model = models.alexnet(10, hidden=64)
    balance = example.equal_flops_balance(model, torch.randn(1, 3, 64, 64), 3)
    assert sum(balance) == len(model) and len(balance) == 3
    starts = [sum(balance[:j]) for j in range(1, 3)]
    assert all(isinstance(model[i], torch.nn.Conv2d | torch.nn.Linear) for i in starts)


def test_timeline_is_written_as_a_chrome_trace(example: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    text = _run(example, "--steps", "1", "--devices", "cpu,cpu", "--timeline", str(path), *_FAST)
    assert f"written to {path}" in text
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1}
    assert {"F0", "F1", "B0", "B1"} <= {e["name"] for e in events}
    assert all(e["dur"] >= 0 for e in events)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--image-size", "32"], "--image-size"), (["--chunks", "0"], "--chunks"),
     (["--balance", "a,b"], "--balance"), (["--timeline", "t.pdf"], "--timeline")],
)  # fmt: skip
def test_bad_flags_exit_with_a_usage_error(
    example: ModuleType, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        example.main(argv, out=io.StringIO())
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_balance_that_does_not_fit_is_reported_not_raised(
    example: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--devices", "cpu,cpu", "--balance", "10,10", *_FAST]
    assert example.main(argv, out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "[10, 10]" in err and "22" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_every_gpu_by_default(example: ModuleType) -> None:
    text = _run(example, "--steps", "3", *_FAST)
    for i in range(torch.cuda.device_count()):
        assert f": cuda:{i}  layers" in text
    first, last = _losses(text)
    assert last < first
