"""The command line end to end: models by name, JSON and HTML written, errors on one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipepar.cli.main import main
from pipepar.cli.model_loader import load_model, resolve_builder


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_zoo_model_writes_json_and_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, page = tmp_path / "plan.json", tmp_path / "report.html"
    code, out, err = _run(
        capsys,
        "profile",
        "pipepar.zoo:alexnet",
        "--input-shape",
        "64,3,224,224",
        "--devices",
        "4",
        "--capacity",
        "2GiB",
        "--chunks",
        "8",
        "--optimizer",
        "adam",
        "--json",
        str(js),
        "--html",
        str(page),
    )
    assert code == 0 and err == ""
    data = json.loads(js.read_text())
    assert len(data["balance"]) == 4 and sum(data["balance"]) == len(data["layers"])
    assert (
        data["config"]["capacity_bytes"] == [2 * 2**30] * 4
        and data["config"]["optimizer"] == "adam"
    )
    assert data["config"]["input_shape"] == [64, 3, 224, 224] and data["fits"]
    assert data["layers"][0]["type_name"] == "Conv2d"
    html = page.read_text()
    assert html.count("<svg") == 2 and f"balance <b>{data['balance']}</b>" in html
    assert "Not measured: the profile ran on meta" in html  # no times on meta
    assert "Stages (gpipe, 8 micro-batches of 8 rows" in out and "bubble" in out


def test_torchvision_names_and_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "profile",
        "resnet18",
        "--input-shape",
        "8,3,64,64",
        "--devices",
        "cuda:0,cuda:1",
        "--capacity",
        "1GiB,2GiB",
        "--schedule",
        "1f1b",
        "--json",
        "-",
        "--quiet",
    )
    data = json.loads(out)
    assert code == 0 and data["config"]["schedule"] == "1f1b"
    assert data["config"]["devices"] == ["cuda:0", "cuda:1"]
    assert [s["in_flight"] for s in data["stages"]] == [2, 1]
    code, out, _ = _run(
        capsys,
        "profile",
        "torchvision.models.resnet18",
        "--input-shape",
        "2,3,64,64",
        "--devices",
        "2",
        "--json",
        "-",
        "--quiet",
    )
    assert code == 0 and json.loads(out)["totals"]["params_bytes"] == 11_689_512 * 4


def test_package_module_function_with_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "profile",
        "models.gpt:gpt",
        "--model-kwargs",
        '{"depth": 2, "width": 64, "heads": 4, "vocab": 100, "seq_len": 16}',
        "--input-shape",
        "4,16",
        "--input-dtype",
        "long",
        "--vocab",
        "100",
        "--devices",
        "2",
        "--chunks",
        "2",
        "--json",
        "-",
        "--quiet",
    )
    data = json.loads(out)
    assert code == 0 and data["layers"][-1]["output_shape"] == [4, 16, 100]


def test_no_fitting_split_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys,
        "profile",
        "models.alexnet",
        "--input-shape",
        "8,3,224,224",
        "--devices",
        "2",
        "--capacity",
        "100MB",
    )
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "layer 16 (Linear)" in err and "short by" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--bogus"],
            "unrecognized arguments: --bogus",
        ),
        (["profile", "models.mlp"], "--input-shape"),
        (
            ["profile", "models.mlp", "--input-shape", "8,x"],
            "--input-shape '8,x' must be positive ints",
        ),
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--capacity", "abc"],
            "is not a byte size",
        ),
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--capacity=-1GiB"],
            "must not be negative",
        ),
        (
            ["profile", "models.mlp", "--input-shape", "8,16"],
            "layer 0 (Linear) failed on an input of shape (8, 16)",
        ),
        (["profile", "models.mlp", "--input-shape", "8,1024", "--devices", "0"], "--devices 0"),
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--devices", "gpu:x"],
            "not a device name",
        ),
        (["profile", "models.mlp", "--input-shape", "8,1024", "--chunks", "0"], "--chunks 0"),
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--schedule", "zz"],
            "invalid choice",
        ),
        (["profile", "models.mlp", "--input-shape", "8,1024", "--optimizer", "adamx"], "not known"),
        (["profile", "nosuch.module:fn", "--input-shape", "8,3"], "cannot import 'nosuch.module'"),
        (["profile", "models.nosuch", "--input-shape", "8,3"], "has no 'nosuch'"),
        (["profile", "resnet9000", "--input-shape", "8,3"], "not a torchvision model"),
        (
            ["profile", "models.mlp", "--input-shape", "8,1024", "--model-kwargs", "{"],
            "is not JSON",
        ),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("pipepar: error: ") and err.count("\n") == 1
    assert message in err


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipepar",
            "profile",
            "models.mlp",
            "--input-shape",
            "16,1024",
            "--devices",
            "2",
            "--json",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "p.json").read_text())["balance"] == [8, 8]


def test_model_loader_resolves_every_spelling() -> None:
    assert resolve_builder("pipepar.zoo:llama3_70b").__name__ == "llama3_70b"
    assert resolve_builder("pipepar.zoo.alexnet").__name__ == "alexnet"
    assert resolve_builder("models.alexnet").__name__ == "alexnet"
    assert resolve_builder("models:mlp").__name__ == "mlp"
    model = load_model("vgg11", device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ValueError, match="did you mean"):
        resolve_builder("resnet")


def test_plan_any_model_over_its_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pipepar plan`` takes a transformers model as it is (a zoo builder, or a config.json)
    and plans over its units, fed token ids as input_ids= and labels=."""
    js = tmp_path / "plan.json"
    code, out, err = _run(
        capsys, "plan", "models.transformers_zoo:gpt2", "--tokens", "4,16", "--devices", "2",
        "--capacity", "1GiB", "--chunks", "2", "--schedule", "1f1b", "--json", str(js),
    )
    assert code == 0, err
    data = json.loads(js.read_text())
    names = [layer["name"] for layer in data["layers"]]
    assert names[0] == "transformer.wte" and names[-1] == "lm_head" and "transformer.h.3" in names
    assert len(data["balance"]) == 2 and sum(data["balance"]) == len(names) and data["fits"]
    assert "Stages (1f1b, 2 micro-batches of 2 rows" in out
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "dtype": "bfloat16",
            }
        )
    )
    code, out, err = _run(
        capsys, "plan", "--hf-config", str(config), "--tokens", "2,32", "--devices", "2",
        "--json", "-", "--quiet",
    )
    assert code == 0, err
    data = json.loads(out)
    assert [x["name"] for x in data["layers"]][2:5] == [f"model.layers.{i}" for i in range(3)]
    layer = data["layers"][2]
    assert layer["params_bytes"] == 2 * (4 * 32 * 32 // 2 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--tokens", "2,8"], "MODEL"),
        (["plan", "llama3_70b", "--tokens", "2,8"], "pipepar.zoo:llama3_70b"),
        (["plan", "models.transformers_zoo:gpt2"], "--tokens"),
        (["plan", "models.transformers_zoo:gpt2", "--tokens", "2,8,3"], "two numbers"),
        (["plan", "--hf-config", "/nonexistent/config.json", "--tokens", "2,8"], "--hf-config"),
    ],
)
def test_plan_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_help_says_how_to_name_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("profile", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "pipepar.zoo:NAME" in out and "llama3_70b" in out
        assert "package.module:function" in out and "current directory" in out


def test_own_model_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pipepar`` (a console script) starts with only its own folder and the installed packages
    on the path; a MODEL in the current directory is found all the same."""
    (tmp_path / "cli_own_net.py").write_text(
        "from torch import nn\n\n\ndef build(width=16):\n"
        "    return nn.Sequential(nn.Linear(width, width), nn.ReLU())\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out, err = _run(
        capsys, "profile", "cli_own_net:build", "--input-shape", "8,16", "--devices", "2",
        "--json", "-", "--quiet",
    )
    assert code == 0, err
    assert json.loads(out)["balance"] == [1, 1]
    assert sys.path[-1] == str(tmp_path)  # last: a folder here never hides an installed package
