"""Run a benchmark script as ``python benchmarks/NAME.py ARGS`` runs it, in a fresh process that
starts with torch and pipepar imported (or, for a script that starts processes of its own, in a
new interpreter).

Each script gets a process of its own (its ``__main__``, its argument list, its exit status, its
stdout and stderr), forked from the tests' fork server (:func:`tests._ranks.context`), which
imported torch, pipepar and transformers once: a script then starts in milliseconds rather than
the seconds a new interpreter spends importing them, over the thirty-odd scripts of the smoke
tests. What the script itself imports and does is as from the command line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from tests._ranks import context, settle

__all__ = ["run_script"]

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>`` from the repository's root: its exit status and
    output."""
    path = ROOT / "benchmarks" / script
    if _starts_processes(path):  # its children start from its file: a new interpreter
        cmd = [sys.executable, str(path.relative_to(ROOT)), *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = context().Process(
            target=_main, args=(str(path), list(args), str(out), str(err), dict(os.environ))
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([str(path), *args], timeout)
        return subprocess.CompletedProcess(
            [str(path), *args], process.exitcode, out.read_text(), err.read_text()
        )


def _starts_processes(path: Path) -> bool:
    """Whether the script starts processes of its own (ranks, a torchrun): those re-create its
    ``__main__`` from how the interpreter started, which a fork of the server is not."""
    return (
        re.search(r"ProcessGroup|get_context|multiprocessing|torchrun|subprocess", path.read_text())
        is not None
    )


def _main(path: str, args: list[str], out: str, err: str, env: dict[str, str]) -> None:
    settle(env)
    os.chdir(ROOT)
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    typed = str(Path(path).relative_to(ROOT))  # benchmarks/x.py, as sys.argv[0] has it
    sys.argv = [typed, *args]
    sys.path.insert(0, str(Path(path).parent))  # as ``python benchmarks/x.py`` puts it first
    # The script's module is ``__main__`` as with ``python script.py`` (no spec, its file), so
    # that what it pickles by reference and the processes it starts find it there.
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = path, None
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    code: object = 0
    try:
        exec(compile(Path(path).read_text(), typed, "exec"), main.__dict__)
    except SystemExit as done:
        code = done.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code is not None and not isinstance(code, int):  # SystemExit("message")
        print(code, file=sys.stderr)
        sys.stderr.flush()
        code = 1
    os._exit(code or 0)
