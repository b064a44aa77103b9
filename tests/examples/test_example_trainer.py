"""examples/trainer_split.py trains GPT-2 through a pipe with HF Trainer and the loss falls."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer_split.py"
_FAST = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--rows", "64"]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_split", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_trains_the_pipe_and_the_loss_falls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_FAST, "--batch-size", "4", "--steps", "8", "--log-every", "2", "--lr", "1e-2"]
    losses = _example().main([*argv, "--output-dir", str(tmp_path)])
    assert len(losses) == 4
    assert losses[-1] < 0.9 * losses[0]
    out = capsys.readouterr().out
    assert "stage 1 on cpu: transformer.h.1 .. lm_head" in out
    assert "Trainer sees GPT2LMHeadModel with forward(input_ids, " in out
    assert "step   8  loss" in out


def test_help_describes_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        _example().main(["--help"])
    assert done.value.code == 0
    assert "Hugging Face's Trainer" in capsys.readouterr().out
