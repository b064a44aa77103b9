"""What the benchmark scripts share: workloads, balance, alternating rounds, statistics, options.

A *workload* is a model with its batch, target and loss. Every script times contenders in
alternating rounds (the order rotates each round) so that a load change on the shared machine
hits all contenders alike, and reports the median over rounds with the min-max spread.

Against a limit (``bench_schedules.py``, ``bench_models.py``): each contender runs a *block* of
steps per round (:func:`local_block`, :func:`remote_block` on spawned ranks), an error drops
only its contender (:func:`guard`, :func:`run_blocks`), and every step becomes a rate compared
with the same run's one-core reference and limit (:func:`against_limit`, :func:`limit_table`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._results import RESULTS, markdown_table

Loss = Callable[[Tensor, Tensor], Tensor]
Step = Callable[[], None]
T = TypeVar("T")
WORKLOADS = ("mlp", "alexnet", "gpt")
TINY = "tiny"
"""A workload outside WORKLOADS: so little to compute per action that host time decides."""


@dataclass
class Workload:
    """A model, one mini-batch of inputs and targets, and the loss."""

    name: str
    model: nn.Sequential
    x: Tensor
    y: Tensor
    loss: Loss
    description: str

    @property
    def batch(self) -> int:
        """Rows in the mini-batch."""
        return int(self.x.shape[0])


def accumulation_step(
    work: Workload, m: int, device: str = "cpu", *, optimizer: bool = True
) -> Step:
    """The one-device reference: the same m micro-batches one after another, then one
    optimizer step (gradient accumulation), on a copy of the workload's model on ``device``.

    ``optimizer=False``: no SGD step, only the gradients set to None after the backwards.
    """
    model = copy.deepcopy(work.model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = work.x.to(device).tensor_split(m), work.y.to(device).tensor_split(m)

    def step() -> None:
        for x, y in zip(xs, ys):
            (work.loss(model(x), y) / m).backward()
        if optimizer:
            opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize([device])

    return step


def synchronize(devices: list[str]) -> None:
    """Wait for the work queued on each CUDA device in ``devices`` (a step's time includes it)."""
    for name in sorted(set(devices)):
        device = torch.device(name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def stage_devices(kind: str, k: int) -> list[str]:
    """``k`` stage devices: ``cpu`` for every stage, or ``cuda:0`` .. ``cuda:k-1``."""
    return ["cpu"] * k if kind == "cpu" else [f"cuda:{j}" for j in range(k)]


def _mlp_inline(depth: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _gpt_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def workload(
    name: str, *, quick: bool = False, seed: int = 0, width: int | None = None
) -> Workload:
    """Build the named workload (``"mlp"``, ``"alexnet"``, ``"gpt"`` or ``"tiny"``), seeded, on
    the CPU.

    ``quick`` shrinks every size so one step takes milliseconds (for CI). ``width``: the tiny
    workload's layer width (default 64; the other workloads have their own sizes).
    """
    if width is not None and name != TINY:
        raise ValueError(f"width={width} applies to the {TINY!r} workload only, not {name!r}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == TINY:  # the same sizes in quick mode: already tiny
        width, batch = width or 64, 64
        model = _mlp_inline(8, width)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
        text = f"8 x (Linear({width}, {width}) + ReLU), batch {batch}"
        return Workload(name, model, x, y, F.mse_loss, text)
    if name == "mlp":
        depth, width, batch = (4, 64, 32) if quick else (8, 1024, 256)
        try:
            import models

            model = models.mlp(depth=depth, width=width)
        except ImportError:  # the zoo is optional for this one
            model = _mlp_inline(depth, width)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
        text = f"{depth} x (Linear({width}, {width}) + ReLU), batch {batch}"
        return Workload(name, model, x, y, F.mse_loss, text)
    import models

    if name == "alexnet":
        hidden, size, batch = (64, 63, 8) if quick else (1024, 96, 64)
        model = models.alexnet(10, hidden=hidden)
        x = torch.randn(batch, 3, size, size, generator=gen)
        y = torch.randint(10, (batch,), generator=gen)
        text = f"AlexNet (fc {hidden}, 10 classes), {size}x{size} images, batch {batch}"
        return Workload(name, model, x, y, F.cross_entropy, text)
    if name == "gpt":
        depth, width, heads, vocab, seq, batch = (
            (2, 32, 2, 64, 16, 8) if quick else (8, 256, 4, 2048, 64, 32)
        )
        model = models.gpt(depth, width, heads, vocab, seq)
        x = torch.randint(vocab, (batch, seq), generator=gen)
        y = torch.randint(vocab, (batch, seq), generator=gen)
        text = f"GPT {depth} blocks x {width} wide, vocab {vocab}, {batch} x {seq} tokens"
        return Workload(name, model, x, y, _gpt_loss, text)
    raise ValueError(f"workload {name!r} is not one of {(*WORKLOADS, TINY)}; pass e.g. 'mlp'")


def layer_flops(model: nn.Sequential, sample: Tensor) -> list[int]:
    """Forward FLOPs of each layer on ``sample`` (counted by ``torch.utils.flop_counter``)."""
    flops = []
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                sample = layer(sample)
            flops.append(counter.get_total_flops())
    return flops


def balance(work: Workload, k: int) -> list[int]:
    """Layers per stage that even out forward FLOPs (exact min-max split, pipepar.partition)."""
    import pipepar

    costs = [f + 1 for f in layer_flops(work.model, work.x[:1])]  # +1: ReLUs are not free
    return list(pipepar.partition(costs, k))


@dataclass(frozen=True)
class Stats:
    """Median and min-max of one contender's per-round values."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        return cls(statistics.median(values), min(values), max(values))

    def spread(self) -> float:
        """(max - min) / median."""
        return (self.high - self.low) / self.median if self.median else 0.0


@dataclass(frozen=True)
class Quantiles:
    """10th, 50th and 90th percentile of many values (e.g. per-step rates)."""

    p10: float
    median: float
    p90: float

    @classmethod
    def of(cls, values: list[float]) -> Quantiles:
        if len(values) < 2:
            return cls(values[0], values[0], values[0])
        cuts = statistics.quantiles(values, n=10, method="inclusive")
        return cls(cuts[0], statistics.median(values), cuts[-1])

    def spread(self) -> float:
        """(p90 - p10) / median."""
        return (self.p90 - self.p10) / self.median if self.median else 0.0


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (inclusive method), as :class:`Quantiles` takes it."""
    return Quantiles.of(list(values)).p90


def ratio_interval(
    top: Sequence[float],
    bottom: Sequence[float],
    stat: Callable[[Sequence[float]], float] = p90,
    *,
    resamples: int = 2000,
    level: float = 0.90,
    seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap interval of ``stat(top) / stat(bottom)``: both samples are redrawn with
    replacement ``resamples`` times; the central ``level`` of the ratios. It says how sure a
    ratio of two measured quantiles is (the p10-p90 spread of single steps does not).

    Example:
        >>> lo, hi = ratio_interval([2.0, 2.1, 1.9] * 10, [1.0, 1.05, 0.95] * 10)
        >>> 1.8 < lo <= hi < 2.3
        True
    """
    rng = random.Random(seed)
    ratios = sorted(
        stat(rng.choices(top, k=len(top))) / stat(rng.choices(bottom, k=len(bottom)))
        for _ in range(resamples)
    )
    cut = int(resamples * (1 - level) / 2)
    return ratios[cut], ratios[resamples - 1 - cut]


def training_step(pipe: Any, work: Workload) -> Step:
    """One ``pipe.step`` on ``work``'s batch, its gradients let go after it (each timed step
    makes them anew, as a training loop's ``zero_grad(set_to_none=True)`` has it)."""

    def step() -> None:
        pipe.step(work.x, work.y, work.loss)
        pipe.zero_grad(set_to_none=True)

    return step


def step_times(step: Step, steps: int, cpu: list[float] | None = None) -> list[float]:
    """Run ``step`` ``steps`` times; the seconds each call took. ``cpu``: append each call's
    CPU seconds (all of this process's threads) to it too."""
    times = []
    for _ in range(steps):
        clock, start = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.process_time() - clock)
    return times


def timer(step: Step, steps: int) -> Callable[[], float]:
    """A contender for :func:`alternate`: run ``step`` ``steps`` times, return seconds per step."""

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps

    return timed


def alternate(contenders: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Call every contender once per round, rotating the order; collect what each returns."""
    names = list(contenders)
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(contenders[name]())
    return out


# -- blocks of timed steps against a limit (bench_schedules.py, bench_models.py) ----------------
Block = Callable[[], list[float]]


class RemoteError(RuntimeError):
    """An error text that came back from spawned ranks (its type is named in the text)."""


def local_block(step: Step, block: int, warmup: int, cpu: list[float] | None = None) -> Block:
    """A block timer for :func:`run_blocks`: ``warmup`` untimed calls of ``step``, then the
    seconds of each of ``block`` calls (``cpu``: each call's CPU seconds appended to it)."""

    def timed() -> list[float]:
        for _ in range(warmup):
            step()
        return step_times(step, block, cpu)

    return timed


def remote_block(
    group: Any, key: str, m: int, block: int, warmup: int, cpu: list[float] | None = None
) -> Block:
    """A block timer of contender ``key`` on a :class:`benchmarks._procs.ProcessGroup`: every
    step started after a barrier, the slowest rank's seconds; an error raises
    :class:`RemoteError`. ``cpu``: each step's CPU seconds, all ranks' summed, appended to it."""

    def timed() -> list[float]:
        answer = group.step_costs(key, m, block, warmup)
        if isinstance(answer, str):
            raise RemoteError(answer)
        if cpu is not None:
            cpu.extend(c for _, c in answer)
        return [wall for wall, _ in answer]

    return timed


def why(error: Exception) -> str:
    """``n/a: <the error's last line naming an error>``, for a table's row."""
    text = str(error) if isinstance(error, RemoteError) else f"{type(error).__name__}: {error}"
    lines = text.strip().splitlines() or [type(error).__name__]
    line = next((t for t in reversed(lines) if "Error" in t), lines[-1])
    return "n/a: " + line.removeprefix("error: ")[:160]


def guard(key: str, timer: Block, skipped: dict[str, str]) -> Block:
    """``timer``, but an error drops the contender (noted in ``skipped``) and the rest go on."""

    def call() -> list[float]:
        if key in skipped:
            return []
        try:
            return timer()
        except Exception as error:
            skipped[key] = why(error)
            return []

    return call


def run_blocks(
    timers: dict[str, Block], skipped: dict[str, str], rounds: int, order: Sequence[str]
) -> dict[str, list[float] | str]:
    """Every timer once per round (:func:`alternate`, each :func:`guard`-ed); per key of
    ``order``: the seconds of all its timed steps, or why it has none (from ``skipped``)."""
    runs = alternate({k: guard(k, t, skipped) for k, t in timers.items()}, rounds)
    steps = {k: [t for r in v for t in r] for k, v in runs.items()}
    return {k: skipped.get(k) or steps.get(k) or "n/a: no steps" for k in order}


def against_limit(
    times: dict[str, list[float] | str], samples: Mapping[str, float], unit: str, limit: str
) -> dict[str, dict[str, Any]]:
    """Per key of ``times`` (seconds of each step, or an error's text): the rates
    (``samples[key]`` per step / step time) as quantiles, x ``unit`` and the fraction of
    ``limit`` (p90 against p90, medians, and a bootstrap interval of the p90 ratio), or
    ``{"steps": 0, "error": text}``."""
    rates = {
        k: [samples[k] / t for t in v] for k, v in times.items() if not isinstance(v, str) and v
    }
    ref, top = (Quantiles.of(rates[k]) if rates.get(k) else None for k in (unit, limit))
    out: dict[str, dict[str, Any]] = {}
    for key, value in times.items():
        if key not in rates:
            out[key] = {"steps": 0, "error": value if isinstance(value, str) else "n/a: no steps"}
            continue
        q = Quantiles.of(rates[key])
        out[key] = {
            "steps": len(rates[key]),
            "error": None,
            "median": q.median,
            "p10": q.p10,
            "p90": q.p90,
            "spread": q.spread(),
            "x_one_core": q.p90 / ref.p90 if ref else None,
            "of_limit": q.p90 / top.p90 if top else None,
            "of_limit_median": q.median / top.median if top else None,
            "of_limit_interval": (
                ratio_interval(rates[key], rates[limit]) if top and key != limit else None
            ),
            "rates": rates[key],
        }
    return out


def limit_table(result: list[dict[str, Any]], notes: Callable[[dict[str, Any]], str]) -> str:
    """Markdown, one line per row of :func:`against_limit` (with ``contender``, ``schedule``,
    ``processes``): rates, x one core and the fraction of the limit; ``notes(row)`` last."""
    lines = []
    for r in result:
        head = [r["contender"], r["schedule"], r["processes"]]
        if r["error"]:
            lines.append([*head, "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        x = "-" if r["x_one_core"] is None else f"{r['x_one_core']:.2f}x"
        frac = "-" if r["of_limit"] is None else f"{r['of_limit']:.2f} ({r['of_limit_median']:.2f})"
        lo_hi = r["of_limit_interval"]
        sure = "-" if lo_hi is None else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"
        cells = [f"{r['median']:.0f}", f"{r['p90']:.0f}", f"{r['spread']:.0%}", x, frac, sure]
        lines.append([*head, *cells, notes(r)])
    headers = ["contender", "schedule", "processes", "samples/s median", "samples/s p90"]
    headers += ["spread p10-p90", "x one core (p90)", "of limit p90 (median)"]
    headers += ["of limit p90, 90% interval", "notes"]
    return markdown_table(headers, lines)


def load() -> str:
    """The machine's 1/5/15-minute load averages, for the notes."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def add_options(parser: argparse.ArgumentParser, *, rounds: int) -> None:
    """The options every benchmark takes: --quick, --rounds, --results, --json."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, one round: seconds, for CI (writes to a temp file)",
    )
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="markdown file to write the section to (default: benchmarks/"
        "RESULTS.md, or a temp file with --quick)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")


def add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark that times schedules on K devices: --steps, --chunks,
    --workers (comma-separated K) and --write."""
    parser.add_argument("--steps", type=int, default=24, help="timed steps per contender")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (M)")
    parser.add_argument(
        "--workers",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[2, 4],
        help="devices K, comma-separated (default 2,4)",
    )
    parser.add_argument("--write", action="store_true", help="write the section (--results)")


def results_path(args: argparse.Namespace, script: str) -> Path:
    """Where to record: --results, else a temp file in quick mode, else RESULTS.md."""
    if args.results is not None:
        return Path(args.results)
    if args.quick:
        return Path(tempfile.gettempdir()) / f"pipepar-{script}-quick.md"
    return RESULTS


def write_json(path: Path | None, rows: list[dict[str, object]]) -> None:
    """Write rows as a JSON list (nothing when ``path`` is None)."""
    if path is not None:
        Path(path).write_text(json.dumps(rows, indent=1))


def stage_ranges(balance: list[int]) -> list[tuple[int, int]]:
    """(first, last) layer index of each stage, inclusive."""
    out, start = [], 0
    for n in balance:
        out.append((start, start + n - 1))
        start += n
    return out
