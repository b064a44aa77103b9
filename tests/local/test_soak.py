"""A short soak (200 steps): no thread growth, no run left alive, bounded memory growth.

The full 1,000-step run is ``python benchmarks/bench_soak.py`` (figures in RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_soak
from benchmarks._results import RESULTS

MiB = 1 << 20


def test_200_steps_leave_no_threads_runs_or_memory_behind() -> None:
    result = bench_soak.soak(200, every=25, warmup=50)
    assert result.failed_steps == 2  # the injected faults happened and training went on
    settled = result.settled
    assert [s.step for s in settled] == list(range(50, 201, 25))
    assert {s.pipe_threads for s in settled} == {len(bench_soak.BALANCE)}  # one per stage
    assert result.thread_growth == 0
    assert max(s.os_threads for s in settled) == min(s.os_threads for s in settled)
    # Every pipeline run (and the activations it holds) is freed once its step is over. A run
    # left alive per step holds about 1 MiB here; 150 of them would be far past this margin.
    assert [s.live_runs for s in settled] == [0] * len(settled)
    assert result.rss_growth < 16 * MiB, result.rss_growth


def test_quick_mode_records_to_a_temporary_file(tmp_path: Path) -> None:
    before = RESULTS.read_text() if RESULTS.exists() else None
    out = tmp_path / "soak.md"
    result = bench_soak.main(["--quick", "--steps", "24", "--results", str(out)])
    assert result.steps == 24
    text = out.read_text()
    assert f"## {bench_soak.TITLE}" in text and "| step | RSS |" in text
    assert "24 steps in" in text
    assert (RESULTS.read_text() if RESULTS.exists() else None) == before
