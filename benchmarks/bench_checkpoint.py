"""Training checkpoints across ranks: ``ppd.save_checkpoint`` to a sharded directory (every
writing rank its own part, through torch.distributed.checkpoint) against one ``.pt`` file
(the pipeline's state gathered on its first rank, which writes it), and ``load_checkpoint`` of
each into a fresh pipe and optimizer.

Setup: an ``nn.Sequential`` of ``--depth`` x ``Linear(width, width)``, built on the meta device
and split by ``ppd.wrap(model, balance, dp=--dp, chunks=4)`` over ``2 x dp`` gloo ranks on
localhost (pp=2, one math thread each); one AdamW step gives the optimizer its state. The
width comes from ``--size-mb`` (model + AdamW state, 12 bytes per parameter; default 1024) or
``--width``. Each round saves and loads each format (the order rotating from round to round):

- **save**: a barrier, ``save_checkpoint``, a barrier; the slowest rank's seconds;
- **load**: a fresh pipe (other weights) and a fresh AdamW (no state), then the same around
  ``load_checkpoint``; afterwards every tensor of the pipe's and the optimizer's state dict
  must be ``torch.equal`` to the saved pipe's;
- **peak memory**: per rank, the highest resident set size during the call above the RSS just
  before it. The kernel's high-water mark (``VmHWM``) is reset before the call (writing ``5``
  to ``/proc/self/clear_refs``) and read after it: that sees every page, however briefly held.
  ``ru_maxrss`` cannot be reset, so after building the model its deltas read 0; a sampling
  thread misses peaks shorter than its period. Where the reset is refused, a thread samples
  ``VmRSS`` every 2 ms instead (the notes say which ran);
- **bytes written**: the sizes of every file the save left.

    python benchmarks/bench_checkpoint.py --write               # ~1 GB, 2 ranks, 5 rounds
    python benchmarks/bench_checkpoint.py --dp 2 --size-mb 2048 --rounds 3
    python benchmarks/bench_checkpoint.py --quick               # seconds; CI smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import functools
import gc
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._procs import free_port
from benchmarks._results import markdown_table, record

TITLE = "Checkpoints: sharded directory against one gathered file"
FORMATS = {"directory": "ckpt", "file": "ckpt.pt"}  # format -> the path's name
BYTES_PER_PARAMETER = 12  # fp32 weight + AdamW's exp_avg and exp_avg_sq
CHUNKS, ROWS, MIB = 4, 8, 2**20


# -- the model ---------------------------------------------------------------------------------
def width_for(size_mb: float, depth: int) -> int:
    """The widest ``Linear(w, w)`` of which ``depth`` (weights, biases, AdamW state) fit in
    ``size_mb`` MiB.

    Example:
        >>> width_for(1024, 8)
        3343
    """
    parameters = size_mb * MIB / BYTES_PER_PARAMETER / depth  # = w * w + w
    return int((math.sqrt(1 + 4 * parameters) - 1) / 2)


def _pipe(args: argparse.Namespace) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's pipe (its layers initialised by ``reset_parameters``) and a new AdamW."""
    import pipepar.distributed as ppd

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    half = args.depth // 2
    pipe = ppd.wrap(model, [half, args.depth - half], dp=args.dp, chunks=CHUNKS)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3)


def _train_once(pipe: Any, opt: torch.optim.Optimizer, width: int) -> None:
    """One step, so that AdamW holds ``step``, ``exp_avg`` and ``exp_avg_sq``."""
    gen = torch.Generator().manual_seed(pipe.dp_rank)
    x, y = torch.randn(ROWS, width, generator=gen), torch.randn(ROWS, width, generator=gen)
    pipe.step(x, y, nn.functional.mse_loss)
    opt.step()
    opt.zero_grad(set_to_none=True)


def same(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same values (tensors: ``torch.equal``).

    Example:
        >>> same({"w": torch.ones(2), "lr": 0.1}, {"w": torch.ones(2), "lr": 0.1})
        True
    """
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


# -- resident memory ---------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; this benchmark needs Linux")


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS
    except OSError:
        return False
    return True


class PeakRss:
    """``with PeakRss() as peak: ...``: ``peak.increase`` is the highest RSS inside the block
    above the RSS at its start, in bytes (the kernel's reset high-water mark, else sampled)."""

    def __init__(self, period: float = 0.002) -> None:
        self.period, self.increase, self.method = period, 0, ""
        self._samples: list[int] = []
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.before = _status_kib("VmRSS")
        self.method = "VmHWM reset" if _reset_high_water_mark() else "VmRSS sampled"
        if self.method == "VmRSS sampled":
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            self._samples.append(_status_kib("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self.method == "VmHWM reset":
            peak = _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            peak = max([*self._samples, _status_kib("VmRSS")])
        self.increase = max(0, peak - self.before) * 1024


# -- the ranks ---------------------------------------------------------------------------------
def _timed(call: Callable[[], object]) -> dict[str, Any]:
    """``call()`` between two barriers: its own seconds, the seconds barrier to barrier, and
    the peak RSS above the RSS before it."""
    dist.barrier()
    start = time.perf_counter()
    with PeakRss() as peak:
        call()
    own = time.perf_counter() - start
    dist.barrier()
    wall = time.perf_counter() - start
    return {
        "s": own,
        "wall_s": wall,
        "peak": peak.increase,
        "rss": peak.before * 1024,
        "method": peak.method,
    }


def _bytes_written(path: Path) -> tuple[int, int]:
    """Bytes and files under ``path`` (a file: itself)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _round(fmt: str, pipe: Any, opt: torch.optim.Optimizer, args: Any) -> dict[str, Any]:
    """Save in ``fmt``, load into a fresh pipe, compare; this rank's figures."""
    import pipepar.distributed as ppd

    path = args.folder / FORMATS[fmt]
    save = _timed(lambda: ppd.save_checkpoint(path, pipe, opt))
    written = _bytes_written(path) if dist.get_rank() == 0 else (0, 0)
    load, equal = _load(path, pipe, opt, args)
    gc.collect()  # the fresh pipe's memory goes back before the next call is measured
    dist.barrier()
    if dist.get_rank() == 0 and path.is_dir():
        shutil.rmtree(path)
    elif dist.get_rank() == 0:
        path.unlink()
    return {
        "format": fmt,
        "save": save,
        "load": load,
        "bytes": written[0],
        "files": written[1],
        "equal": equal,
    }


def _load(
    path: Path, pipe: Any, opt: torch.optim.Optimizer, args: Any
) -> tuple[dict[str, Any], bool]:
    """Load ``path`` into a fresh pipe and AdamW: the figures, and whether every tensor of
    both state dicts equals the saved pipe's."""
    import pipepar.distributed as ppd

    fresh, fresh_opt = _pipe(args)  # reset_parameters: other weights until loaded
    load = _timed(lambda: ppd.load_checkpoint(path, fresh, fresh_opt))
    equal = same(pipe.state_dict(), fresh.state_dict())
    equal = equal and same(opt.state_dict(), fresh_opt.state_dict())
    fresh.close()
    return load, equal


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(rank)
    pipe, opt = _pipe(args)
    _train_once(pipe, opt, args.width)
    rounds: dict[str, Callable[[], dict[str, Any]]] = {
        fmt: functools.partial(_round, fmt, pipe, opt, args) for fmt in FORMATS
    }
    figures = common.alternate(rounds, args.rounds)  # the order rotates round by round
    pipe.close()
    out.put((rank, figures))
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict[str, list[dict[str, Any]]]]:
    """Every rank's figures (ranks in order), per format, of every round."""
    world = 2 * args.dp
    out = mp.get_context("spawn").SimpleQueue()
    args.folder = Path(tempfile.mkdtemp(prefix="pipepar-ckpt-", dir=args.dir))
    try:
        mp.spawn(_worker, args=(world, free_port(), args, out), nprocs=world, join=True)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    answers = dict(out.get() for _ in range(world))
    return [answers[r] for r in range(world)]


# -- report ------------------------------------------------------------------------------------
def rows(per_rank: list[dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per format: the slowest rank's save and load seconds of each round, each rank's median
    peak RSS increase, bytes and files written, and whether every load gave the saved state."""
    out = []
    for fmt in FORMATS:
        mine = [figures[fmt] for figures in per_rank]
        row: dict[str, Any] = {"format": fmt, "ranks": len(per_rank), "rounds": len(mine[0])}
        for phase in ("save", "load"):
            walls = [max(rank[i][phase]["wall_s"] for rank in mine) for i in range(len(mine[0]))]
            row[f"{phase}_s"] = walls
            row[f"{phase}_own_s"] = [
                statistics.median(r[phase]["s"] for r in rank) for rank in mine
            ]
            row[f"{phase}_peak_mib"] = [
                statistics.median(r[phase]["peak"] for r in rank) / MIB for rank in mine
            ]
            row[f"{phase}_rss_mib"] = [
                statistics.median(r[phase]["rss"] for r in rank) / MIB for rank in mine
            ]
        row["bytes"] = statistics.median(r["bytes"] for r in mine[0])
        row["files"] = mine[0][0]["files"]
        row["equal"] = all(r["equal"] for rank in mine for r in rank)
        row["memory_method"] = sorted(
            {r[p]["method"] for rank in mine for r in rank for p in ("save", "load")}
        )
        out.append(row)
    return out


def _seconds(values: list[float]) -> str:
    stats = common.Stats.of(values)
    return f"{stats.median:.2f} ({stats.low:.2f}-{stats.high:.2f})"


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def table(result: list[dict[str, Any]]) -> str:
    """The markdown table, one line per format."""
    lines = [
        [
            r["format"],
            _seconds(r["save_s"]),
            _seconds(r["load_s"]),
            _per_rank(r["save_peak_mib"]),
            _per_rank(r["load_peak_mib"]),
            f"{r['bytes'] / MIB:.0f} in {r['files']} file(s)",
            "yes" if r["equal"] else "NO",
        ]
        for r in result
    ]
    headers = ["format", "save s, median (min-max)", "load s, median (min-max)"]
    headers += ["save: peak RSS +MiB per rank", "load: peak RSS +MiB per rank"]
    headers += ["MiB written", "loaded == saved"]
    return markdown_table(headers, lines)


def notes(args: argparse.Namespace, result: list[dict[str, Any]], before: str) -> str:
    parameters = args.depth * (args.width**2 + args.width)
    methods = sorted({m for r in result for m in r["memory_method"]})
    rss = " / ".join(f"{v:.0f}" for v in result[0]["save_rss_mib"])
    return (
        f"{args.depth} x Linear({args.width}, {args.width}): {parameters / 1e6:.1f} M "
        f"parameters, {parameters * BYTES_PER_PARAMETER / MIB:.0f} MiB with AdamW state; "
        f"balance [{args.depth // 2}, {args.depth - args.depth // 2}], dp={args.dp}, "
        f"{2 * args.dp} gloo ranks x 1 math thread, chunks={CHUNKS}. {args.rounds} rounds, "
        "the formats' order rotating; seconds from a barrier before the call to one after it, "
        "the slowest rank's. Peak RSS: the highest resident set during the call above the "
        f"RSS just before it ({', '.join(methods)}), median over rounds, rank 0 first; RSS "
        f"before a save: {rss} MiB. A load goes into a fresh pipe and a fresh AdamW, so it "
        "includes allocating the optimizer state; it reads files just written (page cache "
        "warm), and the one-file load maps the file (its pages count as resident). "
        f"Checkpoints under {args.folder.parent} ({_filesystem(args.folder)}), fsync on. "
        f"Machine load before: {before}; after: {common.load()}."
    )


def _filesystem(path: Path) -> str:
    """The type of the file system holding ``path``, from /proc/mounts."""
    best, kind = "", "unknown file system"
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if str(path).startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table; write it to RESULTS.md with --write. 0 on success."""
    args = _parse(argv)
    before = common.load()
    result = rows(measure(args))
    text, note = table(result), notes(args, result, before)
    print(text, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes=note, path=common.results_path(args, "checkpoint"))
    common.write_json(args.json, result)
    return 0 if all(r["equal"] for r in result) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=5)
    parser.add_argument("--size-mb", type=float, default=1024, help="model + AdamW state, MiB")
    parser.add_argument("--depth", type=int, default=8, help="Linear layers (>= 2)")
    parser.add_argument("--width", type=int, default=None, help="overrides --size-mb")
    parser.add_argument("--dp", type=int, default=1, choices=(1, 2), help="replicas (x2 ranks)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: temp)")
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.depth, args.rounds = 4, 4, 2
    if args.depth < 2:
        parser.error(f"--depth {args.depth} cannot make 2 stages; pass --depth 2 or more")
    args.width = args.width or width_for(args.size_mb, args.depth)
    return args


if __name__ == "__main__":
    sys.exit(main())
