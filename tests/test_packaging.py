"""pipepar as users install it: the wheel holds the ``pipepar`` package alone, nothing in it
imports what the repository keeps outside it (``models/``, ``tests/``...), and
``pipepar.__version__`` is the installed metadata's. ``scripts/check_wheel.sh`` goes further:
it installs the wheel into a fresh environment and runs the README there."""

from __future__ import annotations

import ast
import importlib.metadata
import zipfile
from pathlib import Path

import pipepar
from pipepar.version import UNKNOWN, installed_version
from scripts.build_dists import build, build_dists, copy_sources, wheel_problems

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {
    "pipepar"
}
"""The repository's folders the wheel leaves out (models, tests, examples, benchmarks...)."""


def _top_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in the file, lazy ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_pipepar_imports_nothing_the_wheel_leaves_out() -> None:
    assert {"models", "tests", "examples", "benchmarks"} <= OUTSIDE
    strays = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "pipepar").rglob("*.py"))
        for name in _top_imports(path) & OUTSIDE
    }
    assert not strays, sorted(strays)


def test_wheel_holds_pipepar_alone(tmp_path: Path) -> None:
    wheel, source = build_dists(tmp_path)
    assert wheel_problems(wheel, source) == []
    version = importlib.metadata.version("pipepar")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert top == {"pipepar", f"pipepar-{version}.dist-info"}
    assert (tmp_path / "dist" / f"pipepar-{version}.tar.gz").is_file()


def test_wheel_check_sees_the_zoo_shipped_beside_pipepar(tmp_path: Path) -> None:
    """The packaging before: ``models`` installed as a top-level package of its own."""
    source = copy_sources(ROOT, tmp_path / "source")
    pyproject = source / "pyproject.toml"
    text, ours = pyproject.read_text(), 'include = ["pipepar*"]'
    assert ours in text
    pyproject.write_text(text.replace(ours, 'include = ["pipepar*", "models*"]'))
    wheel = build("build_wheel", source, tmp_path / "dist")
    assert wheel_problems(wheel, source) == [
        "top-level 'models' in the wheel: only pipepar belongs there"
    ]


def test_version_is_the_installed_metadata() -> None:
    assert pipepar.__version__ == importlib.metadata.version("pipepar")
    assert installed_version("pipepar-not-installed") == UNKNOWN
