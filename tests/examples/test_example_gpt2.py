"""examples/gpt2_split.py trains transformers' GPT-2 through a pipe and the loss falls."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2_split.py"


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpt2_split", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_loss_falls_with_a_split_by_module_path(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--split", "transformer.h.1", "--layers", "2", "--hidden", "64", "--seq", "32"]
    losses = _example().main([*argv, "--steps", "25", "--batch-size", "8"])
    assert losses[-1] < 0.8 * losses[0]
    out = capsys.readouterr().out
    assert "stage 1 on cpu: transformer.h.1 .. lm_head" in out
    assert "head tied to embedding: True" in out
