"""Soak: 1,000 training steps of a small pipe on CPU; memory and threads must stay flat.

Every step is a real training step (forward, backward, Adam) of a 4-stage pipe with dropout in
two stages, batch norm and checkpointing. Mixed in, as in a long job: an evaluation pass under
``no_grad`` every 25 steps, a forward whose output is dropped without backward every 50, and a
step that fails in a layer every 100 (the exception is caught and training goes on). Every
``--every`` steps it samples the resident set size (RSS), the OS threads of the process, the
pipe's worker threads and the pipeline runs still alive. Growth is measured from the first
sample after the warm-up, when allocator caches and thread pools have settled.

    python benchmarks/bench_soak.py              # 1,000 steps, writes benchmarks/RESULTS.md
    python benchmarks/bench_soak.py --quick      # 200 steps, results to a temporary file (CI)
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pipepar  # noqa: E402
from benchmarks._results import RESULTS, markdown_table, record  # noqa: E402
from pipepar.core.units import format_bytes  # noqa: E402
from pipepar.local.executor import Run  # noqa: E402

TITLE = "Soak: memory and threads over a long CPU run"
BALANCE = [3, 3, 3, 3]
WIDTH, BATCH, CHUNKS = 256, 64, 4


@dataclass
class Sample:
    """What one look at the process found after ``step`` steps."""

    step: int
    rss: int
    os_threads: int
    pipe_threads: int
    live_runs: int


@dataclass
class Soak:
    """The samples of a run and the figures derived from them."""

    steps: int
    warmup: int
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    failed_steps: int = 0

    @property
    def settled(self) -> list[Sample]:
        """Samples from the end of the warm-up on."""
        return [s for s in self.samples if s.step >= self.warmup]

    @property
    def rss_growth(self) -> int:
        """RSS at the end minus RSS after the warm-up, in bytes."""
        return self.settled[-1].rss - self.settled[0].rss

    @property
    def rss_spread(self) -> int:
        """Largest minus smallest RSS after the warm-up."""
        return max(s.rss for s in self.settled) - min(s.rss for s in self.settled)

    @property
    def rss_slope(self) -> float:
        """Least-squares RSS trend after the warm-up, in bytes per step."""
        xs = [float(s.step) for s in self.settled]
        ys = [float(s.rss) for s in self.settled]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0

    @property
    def thread_growth(self) -> int:
        """OS threads at the end minus after the warm-up."""
        return self.settled[-1].os_threads - self.settled[0].os_threads


class _FailSwitch(nn.Module):
    """Raises when armed: a fault in the middle of the pipe, as a bad batch would cause."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("injected fault")
        return x


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.GELU(),
        nn.Linear(WIDTH, WIDTH), _FailSwitch(), nn.Dropout(0.1),
        nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 10),
    )  # fmt: skip


def _rss() -> int:
    """Current resident set size (Linux /proc), else the peak (other POSIX systems)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _earlier_threads() -> set[int | None]:
    """The pipepar threads of pipes made before the soak (in a test suite, other tests'):
    those whose pipe is gone are let finish; the others are left out of the counts."""
    gc.collect()
    deadline = time.monotonic() + 5.0
    for t in threading.enumerate():
        if t.name.startswith("pipepar-"):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    return {t.ident for t in threading.enumerate() if t.name.startswith("pipepar-")}


def _sample(step: int, pipe: pipepar.Pipe, earlier: set[int | None]) -> Sample:
    gc.collect()
    first = pipe[0]
    return Sample(
        step=step,
        rss=_rss(),
        os_threads=_os_threads(),
        pipe_threads=sum(
            t.name.startswith("pipepar-stage") and t.ident not in earlier
            for t in threading.enumerate()
        ),
        # this pipe's runs only (type(), not isinstance: some torch objects warn on __class__)
        live_runs=sum(type(o) is Run and o.stages[0].layers[0] is first for o in gc.get_objects()),
    )


def _step(pipe: pipepar.Pipe, opt: torch.optim.Optimizer, step: int) -> bool:
    """One training step (plus the extras of the schedule); False if it failed on purpose."""
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    pipe[7].armed = False
    if step % 25 == 0:
        pipe.eval()
        with torch.no_grad():
            pipe(x)
        pipe.train()
    if step % 50 == 0:
        pipe(x)  # an output nobody backpropagates: its run must be freed with it
    fail = step % 100 == 99
    pipe[7].armed = fail
    opt.zero_grad(set_to_none=True)
    try:
        nn.functional.cross_entropy(pipe(x), y).backward()
    except RuntimeError as error:
        if not fail or "injected fault" not in str(error):
            raise
        return False
    opt.step()
    return True


def soak(steps: int, *, every: int = 50, warmup: int = 100) -> Soak:
    """Train ``steps`` steps, sampling the process every ``every`` steps.

    Example:
        >>> result = soak(200, every=20, warmup=40)
        >>> result.thread_growth
        0
    """
    earlier = _earlier_threads()
    torch.manual_seed(0)
    pipe = pipepar.wrap(
        _model(),
        BALANCE,
        devices=["cpu"] * len(BALANCE),
        chunks=CHUNKS,
        checkpoint="except_last",
        batch_coupling="per-micro-batch",  # its batch norm per micro-batch, as it always ran
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    result = Soak(steps=steps, warmup=warmup)
    start = time.perf_counter()
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            result.samples.append(_sample(step, pipe, earlier))
        if step < steps and not _step(pipe, opt, step):
            result.failed_steps += 1
    result.seconds = time.perf_counter() - start
    pipe.close()
    return result


def table(result: Soak) -> str:
    """The samples as a markdown table."""
    rows = [
        [s.step, format_bytes(s.rss), s.os_threads, s.pipe_threads, s.live_runs]
        for s in result.samples
    ]
    headers = ["step", "RSS", "OS threads", "pipe threads", "live runs"]
    return markdown_table(headers, rows)


def summary(result: Soak) -> str:
    """One paragraph: growth figures and the workload."""
    per_step = result.seconds / max(result.steps, 1) * 1000
    return (
        f"{result.steps} steps in {result.seconds:.1f} s ({per_step:.1f} ms/step) of a "
        f"{len(BALANCE)}-stage pipe ({sum(BALANCE)} layers, width {WIDTH}, batch {BATCH}, "
        f"chunks {CHUNKS}, checkpoint except_last, dropout in 2 stages, Adam); "
        f"{result.failed_steps} steps failed on purpose. After the {result.warmup}-step "
        f"warm-up: RSS growth {format_bytes(result.rss_growth)}, spread "
        f"{format_bytes(result.rss_spread)}, trend {result.rss_slope / 1024:+.2f} KiB/step; "
        f"OS thread growth {result.thread_growth:+d}; live pipeline runs at the end "
        f"{result.samples[-1].live_runs}. The machine is shared: other processes' load changes "
        "timings, not these counts."
    )


def main(argv: list[str] | None = None) -> Soak:
    """Run the soak, print the table, and record it (RESULTS.md, or a temp file with --quick)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="200 steps, results to a temp file")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.add_argument("--results", type=Path, default=None, help="where to record the table")
    args = p.parse_args(argv)
    steps = args.steps or (200 if args.quick else 1000)
    every = max(5, steps // 20)
    result = soak(steps, every=every, warmup=min(100, steps // 4 // every * every))
    text, notes = table(result), summary(result)
    print(text)
    print(notes)
    path = args.results
    if path is None and args.quick:  # a CI smoke run must not replace the full run's figures
        path = Path(tempfile.mkdtemp(prefix="pipepar-soak-")) / "RESULTS.md"
    path = path or RESULTS
    record(TITLE, text, notes=notes, path=path)
    print(f"recorded in {path}")
    return result


if __name__ == "__main__":
    main()
