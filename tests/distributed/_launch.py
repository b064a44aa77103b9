"""torchrun launches for the tests that start jobs as users do: one node or several "nodes"
(torchrun processes on localhost that meet at one rendezvous), each under a time limit.

A launch writes its output to a file (no pipe to fill up) and ends, on time or not: past its
limit it gets SIGTERM (torchrun passes it on to its workers), then its workers and it get
SIGKILL. Workers run in sessions of their own (torchrun starts them so), so they are found
through /proc as the launch's descendants, not through its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENDEZVOUS = ("c10d", "static")
_TERM_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port free on localhost now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(
    script: Path,
    args: list[str],
    *,
    port: int,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rendezvous: str = "c10d",
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line of node ``node_rank`` of ``nnodes``, all on localhost.

    ``rendezvous="c10d"``: dynamic rendezvous at ``127.0.0.1:port`` (nodes take their node
    rank in the order they join); ``"static"``: ``--master-addr/--master-port`` and
    ``--node-rank`` as given (node 0 hosts the store). Workers are polled every 0.1 s, so a
    dead one is noticed at once (torchrun's default for ``--monitor-interval`` as well).
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc), *_meeting(rendezvous, port, node_rank),
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", str(script), *args,
    ]  # fmt: skip


def _meeting(rendezvous: str, port: int, node_rank: int) -> list[str]:
    """torchrun's rendezvous flags (c10d ignores ``--node-rank``, and warns: nodes take their
    node rank in the order they join)."""
    if rendezvous == "c10d":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    if rendezvous == "static":
        return [
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--node-rank",
            str(node_rank),
        ]
    raise ValueError(f"rendezvous={rendezvous!r}; pass one of {RENDEZVOUS}")


@dataclass
class Launch:
    """One running torchrun: :func:`wait` waits for it, :meth:`stop` ends it."""

    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for it, over this process's environment."""
    proc: subprocess.Popen[bytes] = field(init=False)
    ended_at: float | None = None
    """``time.time()`` when it was seen to exit."""

    def __post_init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **self.env}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.time()
        return code

    def stop(self) -> None:
        """SIGTERM, and SIGKILL for it and its descendants if it is still there after a grace."""
        if self.poll() is not None:
            return
        workers = _descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(_TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            workers |= _descendants(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):  # gone with torchrun
                os.kill(pid, signal.SIGKILL)


def launch(command: list[str], log: Path, env: dict[str, str] | None = None) -> Launch:
    """Start ``command`` (a torchrun command line) with ``env`` set, its output going to
    ``log``."""
    return Launch(command, log, dict(env or {}))


def wait(launches: list[Launch], timeout: float) -> None:
    """Wait until every launch has exited; past ``timeout`` seconds stop those still running
    and fail with every launch's output."""
    deadline = time.monotonic() + timeout
    while any(run.poll() is None for run in launches):
        if time.monotonic() > deadline:
            for run in launches:
                run.stop()
            raise AssertionError(f"still running after {timeout:g} s:\n{report(launches)}")
        time.sleep(0.05)


def report(launches: list[Launch]) -> str:
    """Every launch's exit status and the end of its output, for a failing assertion."""
    parts = []
    for i, run in enumerate(launches):
        parts.append(f"--- launch {i}: exit {run.proc.returncode}: {' '.join(run.command)}")
        parts.append(run.output[-6000:])
    return "\n".join(parts)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
