"""Build pipepar's sdist, then its wheel from that sdist, and check what the wheel holds.

Run by ``scripts/check_wheel.sh`` (and ``tests/test_packaging.py``); offline, with the
setuptools of the running interpreter (no build isolation)::

    python scripts/build_dists.py OUT_DIR      # prints the wheel's path

The sources are the files git knows (tracked, or new and not ignored), copied out of the
checkout first, so that the build sees what a fresh clone has and leaves nothing behind. The
wheel must hold ``pipepar`` and its ``.dist-info`` only (no ``models``, ``tests``...), every
module of ``pipepar/`` and the ``pipepar`` command.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "pipepar"
ROOT = Path(__file__).resolve().parent.parent


def copy_sources(root: Path, dest: Path) -> Path:
    """The files git knows under ``root`` (tracked, or untracked and not ignored), copied to
    ``dest``; files deleted from the work tree are left out."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = root / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def build(hook: str, source: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 ``hook`` (``build_sdist`` or ``build_wheel``) in ``source``, in
    a child process (setuptools keeps global state); the file it wrote in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    code = "import sys; from setuptools import build_meta as b; "
    code += "print(getattr(b, sys.argv[1])(sys.argv[2]))"
    done = subprocess.run(
        [sys.executable, "-c", code, hook, str(out)], cwd=source, capture_output=True, text=True
    )
    if done.returncode != 0:
        output = done.stdout[-4000:] + done.stderr[-4000:]
        raise RuntimeError(f"{hook} failed in {source}:\n{output}")
    return out / done.stdout.strip().splitlines()[-1]


def wheel_problems(wheel: Path, source: Path) -> list[str]:
    """What is wrong with ``wheel`` built from ``source``: other top-level entries than
    ``pipepar`` and its dist-info, modules of ``source/pipepar`` missing, no ``pipepar``
    command. Empty when it is right."""
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    problems = [
        f"top-level {t!r} in the wheel: only {PACKAGE} belongs there"
        for t in sorted(top)
        if t != PACKAGE and not _own_dist_info(t)
    ]
    modules = {p.relative_to(source).as_posix() for p in (source / PACKAGE).rglob("*.py")}
    problems += [f"{m} is not in the wheel" for m in sorted(modules - set(names))]
    if f"{PACKAGE}/py.typed" not in names:
        problems.append(f"{PACKAGE}/py.typed is not in the wheel")
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points[0]).decode() if entry_points else ""
    if f"{PACKAGE} = {PACKAGE}.cli.main:main" not in text:
        problems.append(f"the wheel declares no `{PACKAGE}` command")
    return problems


def _own_dist_info(name: str) -> bool:
    return name.startswith(f"{PACKAGE}-") and name.endswith(".dist-info")


def build_dists(out: Path) -> tuple[Path, Path]:
    """Copy the sources to ``out/source``, build the sdist there, unpack it and build the
    wheel from it (both files in ``out/dist``); the wheel's path and the sources'."""
    source = copy_sources(ROOT, out / "source")
    sdist = build("build_sdist", source, out / "dist")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
            tar.extractall(out / "unpacked", filter="data")
        else:
            tar.extractall(out / "unpacked")
    unpacked = out / "unpacked" / sdist.name.removesuffix(".tar.gz")
    return build("build_wheel", unpacked, out / "dist"), source


def main(out: Path) -> Path:
    """Build the sdist and the wheel in ``out`` and check the wheel; its path."""
    wheel, source = build_dists(out)
    problems = wheel_problems(wheel, source)
    if problems:
        raise SystemExit(f"{wheel.name}:\n  " + "\n  ".join(problems))
    return wheel


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {sys.argv[0]} OUT_DIR (an empty directory)")
    print(main(Path(sys.argv[1]).resolve()))
