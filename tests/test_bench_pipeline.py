"""The single-process benchmark runs in quick mode and writes a well-formed table."""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_pipeline


def test_quick_mode_writes_its_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    assert bench_pipeline.main(["--quick", "--results", str(results)]) == 0
    text = results.read_text()
    assert "## Single-process pipeline efficiency" in text
    assert "Command: `python" in text and "Machine:" in text
    rows = [line for line in text.splitlines() if line.startswith("| K=2 M=8")]
    names = [row.split("|")[2].strip() for row in rows]
    assert names[:2] == ["one core, same micro-batches", "pipepar.wrap"]
    for row in rows[1:]:
        fraction = float(row.split("|")[4].split()[0])
        assert 0 <= fraction < 10  # speed is not checked here, only the table
    assert "overhead" in text and "%" in text.split("overhead")[-1]
