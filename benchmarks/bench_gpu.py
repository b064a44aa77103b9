"""One GPU, several stages: what the pipe costs against the plain model on the same GPU.

Every stage sits on ``cuda:0``, so the stages cannot overlap (one GPU runs the kernels of all of
them); the plain model running the same micro-batches one after another is the ceiling, and
what is measured is the pipe's own cost: its threads, hand-offs, loss joining and gradient sums.

Jobs (seeded, random weights, built on the CPU and copied to ``cuda:0`` for every contender):

- ``mlp``: ``models.mlp(8, 4096)`` (8 x Linear(4096, 4096) + ReLU), batch 8192, MSE loss;
- ``gpt``: ``models.gpt(12, 768, 12, 50257, 512)`` (the ``nn.Sequential`` GPT-2-small-shaped
  stack of ``models/``), 32 x 512 tokens, next-token cross-entropy;
- ``gpt2``: transformers' ``GPT2LMHeadModel`` (12 layers x 768, 12 heads, vocabulary 50257,
  tied head; ``models/transformers_zoo.py``), 32 x 512 tokens, its own loss (``labels=``).

Contenders (M = 8 micro-batches, K = 2 workers on ``cuda:0``, ``checkpoint="never"``,
forward + backward, gradients set to None after each step, no optimizer):

- ``plain: micro-batch loop`` (the reference, 1.00): the plain model on cuda:0, the M
  micro-batches one after another, each loss / M, backward after each;
- ``plain: whole batch``: the plain model on the whole batch at once;
- ``pipepar:<schedule>``: ``pipepar.wrap(model, balance or split, devices=["cuda:0"] * 2,
  chunks=8, schedule=...)`` and ``pipe.step`` (2 stages; 4 stages, 2 per worker, for
  interleaved-1f1b and zb-v); ``pipepar-call:gpipe``: ``pipe(x)`` then ``loss.backward()``;
- ``torchgpipe:gpipe``: ``torchgpipe.GPipe(model, balance, devices=["cuda:0"] * 2, chunks=8,
  checkpoint="never")``, ``nn.Sequential`` jobs only (it takes no other model).

Balances: the ``nn.Sequential`` jobs are split by forward FLOPs (``_common.balance``), the same
balance for pipepar and torchgpipe; GPT-2 at equal runs of blocks (``transformer.h.6``; 3, 6, 9
for four stages).

Method: every step is timed on its own between two ``torch.cuda.synchronize()``; per round each
contender runs ``--warmup`` untimed steps then ``--steps`` timed ones, the order rotating from
round to round. Reported: median, p10 and p90 step time over all timed steps, samples/s at the
median, and the reference's median step over the contender's (1.00 = as fast as the plain
micro-batch loop). Peak memory: ``torch.cuda.max_memory_allocated`` reset before each block,
minus what was allocated before it (every contender's model stays on the GPU), plus the
contender's own parameters and the input batch; the largest over rounds. For pipepar beside it,
the planner's prediction (``MemoryModel.device`` over a profile taken on the GPU): the sum of
the two workers' peaks (they share the GPU; each peaks at its own moment, so this is an upper
bound) and the larger worker's.

    python benchmarks/bench_gpu.py --write                 # every job and contender
    python benchmarks/bench_gpu.py --models gpt2 --rounds 1 --steps 3   # a short check

Without CUDA it says so and exits with status 2 (there is no CPU mode: use the other scripts).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import pipepar
from benchmarks import _common as common
from benchmarks._results import RESULTS, markdown_table, record
from pipepar.core.named_schedules import VIRTUAL, make
from pipepar.planner.stage_memory import MemoryModel

TITLE = "One GPU, several stages: pipepar against the plain model (CUDA)"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
JOBS = ("mlp", "gpt", "gpt2")
REFERENCE, WHOLE = "plain: micro-batch loop", "plain: whole batch"
DEVICE = "cuda:0"
GIB = 2**30


@dataclass
class Job:
    """A model on the CPU, its batch (positional ``x``, ``y`` or keyword ``kwargs``)."""

    name: str
    model: nn.Module
    x: Tensor
    y: Tensor | None
    loss: common.Loss | None
    description: str
    blocks: int = 0

    @property
    def sequential(self) -> bool:
        return isinstance(self.model, nn.Sequential)

    @property
    def batch(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Contender:
    """A timed step, the bytes it owns on the GPU, and the planner's figures (pipepar)."""

    step: Callable[[], None]
    resident: int
    predicted: tuple[int, int] | None = None  # (sum of the workers' peaks, the largest)


def _gpt_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def job(name: str) -> Job:
    """The job ``name`` (one of :data:`JOBS`), seeded, on the CPU."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        x, y = torch.randn(8192, 4096, generator=gen), torch.randn(8192, 4096, generator=gen)
        text = "8 x (Linear(4096, 4096) + ReLU), batch 8192, MSE"
        return Job(name, models.mlp(8, 4096), x, y, F.mse_loss, text)
    ids = torch.randint(50257, (32, 513), generator=gen)
    if name == "gpt":
        model = models.gpt(12, 768, 12, 50257, 512)
        text = "models.gpt: 12 blocks x 768, 12 heads, vocab 50257, 32 x 512 tokens"
        return Job(name, model, ids[:, :-1], ids[:, 1:], _gpt_loss, text)
    if name == "gpt2":
        from models import transformers_zoo as zoo

        model = zoo.gpt2(layers=12, hidden=768, heads=12, vocab=50257, positions=1024)
        text = "transformers GPT2LMHeadModel: 12 layers x 768, 12 heads, vocab 50257, tied head, "
        text += "32 x 512 tokens, labels= (its own loss)"
        return Job(name, model, ids[:, :-1], None, None, text, blocks=12)
    raise ValueError(f"job {name!r} is not one of {list(JOBS)}")


def _bytes(tensors: Iterator[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _loss_of(model: nn.Module, work: Job, x: Tensor, y: Tensor | None) -> Tensor:
    if work.sequential:
        assert work.loss is not None and y is not None
        return work.loss(model(x), y)
    return model(input_ids=x, labels=x).loss


def _zeroed(module: nn.Module, backward: Callable[[], Any]) -> Callable[[], None]:
    def step() -> None:
        backward()
        module.zero_grad(set_to_none=True)

    return step


def plain(work: Job, m: int, x: Tensor, y: Tensor | None) -> Contender:
    """The plain model on cuda:0: ``m`` micro-batches one after another (m=1: the batch)."""
    model = copy.deepcopy(work.model).to(DEVICE)
    xs = x.tensor_split(m)
    ys = y.tensor_split(m) if y is not None else [None] * m

    def backward() -> None:
        for xi, yi in zip(xs, ys):
            (_loss_of(model, work, xi, yi) / m).backward()

    return Contender(_zeroed(model, backward), _bytes(model.parameters()))


def layout(work: Job, schedule: str, k: int) -> dict[str, Any]:
    """``balance=`` (nn.Sequential: by forward FLOPs) or ``split=`` (GPT-2: equal blocks)."""
    n = k * (2 if schedule in VIRTUAL else 1)
    if work.sequential:
        assert work.y is not None and work.loss is not None
        flat = common.Workload(work.name, work.model, work.x, work.y, work.loss, "")  # type: ignore[arg-type]
        return {"balance": common.balance(flat, n)}
    if work.blocks % n:
        raise ValueError(f"{work.blocks} blocks do not split into {n} equal stages")
    return {"split": [f"transformer.h.{work.blocks * i // n}" for i in range(1, n)]}


def pipepar_contender(
    work: Job, schedule: str, m: int, k: int, x: Tensor, y: Tensor | None, call: bool
) -> Contender:
    """``pipepar.wrap`` on k cuda:0 workers; ``pipe.step`` (or the call and backward)."""
    model = copy.deepcopy(work.model)
    pipe = pipepar.wrap(
        model, **layout(work, schedule, k), devices=[DEVICE] * k, chunks=m,
        schedule=schedule, checkpoint="never",
    )  # fmt: skip
    if call:
        step = _zeroed(pipe, lambda: _loss_of(pipe, work, x, y).backward())
    elif work.sequential:
        step = _zeroed(pipe, lambda: pipe.step(x, y, work.loss))
    else:
        step = _zeroed(pipe, lambda: pipe.step(input_ids=x, labels=x))
    try:
        figures = predicted(work, pipe, schedule, m, k, x)
    except Exception as error:  # the timing stands without the planner's figures
        print(f"  planner for {schedule}: {common.why(error)}", flush=True)
        figures = None
    return Contender(step, _bytes(pipe.parameters()), figures)


def predicted(work: Job, pipe: Any, schedule: str, m: int, k: int, x: Tensor) -> tuple[int, int]:
    """The planner's peaks of the k workers (profiled on the GPU): their sum and the largest."""
    prof = _profile(work, x)
    balance = list(pipe.balance)
    order = make(schedule, len(balance), m, n_workers=k)
    memory = MemoryModel(prof, order, checkpoint="never", foreach=[True] * k)
    starts = [sum(balance[:j]) for j in range(len(balance))]
    ranges = [(s, s + n - 1) for s, n in zip(starts, balance)]
    peaks = [
        sum(p.peak_bytes for p in memory.device(w, [ranges[s] for s in order.stages_of(w)]))
        for w in range(k)
    ]
    return sum(peaks), max(peaks)


_PROFILES: dict[str, pipepar.Profile] = {}


def _profile(work: Job, x: Tensor) -> pipepar.Profile:
    """The job's profile on the GPU (no optimizer), taken once per job."""
    if work.name not in _PROFILES:
        model = copy.deepcopy(work.model).to(DEVICE)
        if work.sequential:
            prof = pipepar.profile(model, x, device=DEVICE, optimizer=None)
        else:
            from pipepar.planner.model_profile import profile_model

            prof = profile_model(model, {"input_ids": x, "labels": x}, device=DEVICE)
        _PROFILES[work.name] = prof
    return _PROFILES[work.name]


def torchgpipe_contender(work: Job, m: int, k: int, x: Tensor, y: Tensor | None) -> Contender:
    """``torchgpipe.GPipe`` with pipepar's gpipe balance, k stages on cuda:0."""
    from torchgpipe import GPipe

    if not work.sequential:
        raise TypeError("torchgpipe takes an nn.Sequential only")
    balance = layout(work, "gpipe", k)["balance"]
    gpipe = GPipe(copy.deepcopy(work.model), balance, devices=[DEVICE] * k, chunks=m,
                  checkpoint="never")  # fmt: skip
    return Contender(
        _zeroed(gpipe, lambda: _loss_of(gpipe, work, x, y).backward()), _bytes(gpipe.parameters())
    )


def contenders(work: Job, args: argparse.Namespace) -> dict[str, Callable[[], Contender]]:
    """Builders of every contender of ``args.contenders`` that applies to ``work``."""
    x = work.x.to(DEVICE)
    y = work.y.to(DEVICE) if work.y is not None else None
    m, k = args.m, args.k
    out: dict[str, Callable[[], Contender]] = {
        REFERENCE: lambda: plain(work, m, x, y),
        WHOLE: lambda: plain(work, 1, x, y),
    }
    for s in SCHEDULES:
        out[f"pipepar:{s}"] = lambda s=s: pipepar_contender(work, s, m, k, x, y, call=False)
    out["pipepar-call:gpipe"] = lambda: pipepar_contender(work, "gpipe", m, k, x, y, call=True)
    if work.sequential:
        out["torchgpipe:gpipe"] = lambda: torchgpipe_contender(work, m, k, x, y)
    chosen = args.contenders
    return {n: b for n, b in out.items() if n == REFERENCE or not chosen or n in chosen}


# -- measuring ---------------------------------------------------------------------------------
@contextlib.contextmanager
def precision(name: str) -> Iterator[None]:
    """``tf32`` / ``fp32``: TF32 matrix products on or off; ``bf16``: also autocast to bf16."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name != "fp32"
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=name == "bf16"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def block(c: Contender, steps: int, warmup: int) -> tuple[list[float], int]:
    """``warmup`` untimed steps, then ``steps`` timed ones: their seconds and the peak bytes
    allocated above what was there before (+ the contender's own parameters)."""
    for _ in range(warmup):
        c.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        c.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, torch.cuda.max_memory_allocated() - base + c.resident


def measure(work: Job, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every contender of ``work``: built (or n/a), then timed in rotating rounds."""
    built: dict[str, Contender] = {}
    skipped: dict[str, str] = {}
    for name, build in contenders(work, args).items():
        try:
            with precision(args.precision):
                built[name] = build()
        except Exception as error:
            skipped[name] = common.why(error)
        print(f"  built {name}" if name in built else f"  {name}: {skipped[name]}", flush=True)
    times: dict[str, list[float]] = {n: [] for n in built}
    peaks: dict[str, int] = dict.fromkeys(built, 0)

    def timed(name: str) -> Callable[[], None]:
        def run() -> None:
            if name in skipped:
                return
            try:
                with precision(args.precision):
                    got, peak = block(built[name], args.steps, args.warmup)
            except Exception as error:
                skipped[name] = common.why(error)
                return
            times[name] += got
            peaks[name] = max(peaks[name], peak)

        return run

    common.alternate({n: timed(n) for n in built}, args.rounds)
    rows = [_row(work, n, times.get(n, []), peaks.get(n, 0), built.get(n), skipped, args)
            for n in [*built, *(n for n in skipped if n not in built)]]  # fmt: skip
    built.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return _with_ratios(rows)


def _row(
    work: Job,
    name: str,
    times: list[float],
    peak: int,
    c: Contender | None,
    skipped: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    input_bytes = _bytes(t for t in (work.x, work.y) if t is not None)
    row: dict[str, Any] = {"job": work.name, "contender": name, "m": args.m, "k": args.k}
    if name in skipped or not times:
        return {**row, "error": skipped.get(name, "n/a: no steps")}
    q = common.Quantiles.of([t * 1e3 for t in times])
    row |= {"error": None, "steps": len(times), "p10_ms": q.p10, "median_ms": q.median}
    row |= {"p90_ms": q.p90, "samples_per_s": work.batch / (q.median / 1e3)}
    row |= {"peak_bytes": peak + input_bytes, "predicted": c.predicted if c else None}
    return row


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ref = next((r for r in rows if r["contender"] == REFERENCE and not r["error"]), None)
    for r in rows:
        r["of_reference"] = ref["median_ms"] / r["median_ms"] if ref and not r["error"] else None
    return rows


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per job and contender."""
    lines = []
    for r in rows:
        head = [r["job"], r["contender"]]
        if r["error"]:
            lines.append([*head, "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        pred = r["predicted"]
        planned = f"{_gib(pred[0])} ({_gib(pred[1])})" if pred else "-"
        times = [f"{r[k]:.1f}" for k in ("median_ms", "p10_ms", "p90_ms")]
        cells = [*times, f"{r['samples_per_s']:.0f}", f"{r['of_reference']:.2f}"]
        lines.append([*head, *cells, _gib(r["peak_bytes"]), planned, f"{r['steps']} steps"])
    headers = ["job", "contender", "step ms median", "p10", "p90", "samples/s (median)"]
    headers += ["x plain loop (median)", "peak GiB", "planner: sum of workers (largest)", "notes"]
    return markdown_table(headers, lines)


def notes(args: argparse.Namespace, works: list[Job]) -> str:
    jobs = "; ".join(f"`{w.name}`: {w.description}" for w in works)
    props = torch.cuda.get_device_properties(0)
    return (
        f"Jobs: {jobs}. Every stage on cuda:0 ({props.name}, {props.total_memory / GIB:.0f} "
        f"GiB): M={args.m}, K={args.k} workers (2 stages; 4 for interleaved-1f1b and zb-v), "
        f"checkpoint='never', forward + backward, gradients set to None each step, no "
        f"optimizer; precision {args.precision} ({PRECISIONS[args.precision]}). "
        f"{args.rounds} rounds x ({args.warmup} untimed + {args.steps} timed steps) per "
        "contender, order rotating; each step timed alone between torch.cuda.synchronize() "
        "calls. x plain loop = the plain micro-batch loop's median step / the contender's. "
        "What differs: `plain: whole batch` runs one batch of all rows (larger kernels, no "
        "micro-batching); pipepar and torchgpipe run the same M micro-batches as the loop, "
        "through their stage threads (pipepar: a worker thread per device walking the "
        "schedule, each micro-batch's forward of a non-Sequential model on its own thread, "
        "losses joined into the batch's; torchgpipe: its GPipe clock with copy streams), all "
        "kernels on the one GPU. torchgpipe's stage threads do not enter the caller's "
        "autocast: under bf16 its stages compute in float32 (TF32 on). Peak GiB: "
        "torch.cuda.max_memory_allocated during the timed steps above what was allocated "
        "before them, + the contender's parameters + the input "
        "batch. Planner: MemoryModel per worker from a profile on the GPU (no optimizer); "
        "the workers share the GPU and peak at different moments, so their sum bounds the "
        "pipe's peak from above."
    )


PRECISIONS = {
    "tf32": "float32 weights, TF32 matrix products",
    "fp32": "float32, TF32 off",
    "bf16": "float32 weights under torch.autocast('cuda', dtype=torch.bfloat16), TF32 on",
}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        why = "bench_gpu.py needs a CUDA device and there is none here: nothing measured"
        print(f"{why} (the CPU benchmarks are the other scripts of benchmarks/)", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    works = []
    for name in args.models:
        work = job(name)
        works.append(work)
        print(f"{name}: {work.description}", flush=True)
        rows += measure(work, args)
        print(table([r for r in rows if r["job"] == name]), flush=True)
    text = table(rows)
    if args.write or args.results is not None:
        record(TITLE, text, notes=notes(args, works), path=args.results or RESULTS)
    common.write_json(args.json, [{k: v for k, v in r.items()} for r in rows])
    print(notes(args, works))
    return 0


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=_csv, default=list(JOBS), help="jobs: mlp,gpt,gpt2")
    parser.add_argument(
        "--contenders", type=_csv, default=[], help="e.g. pipepar:1f1b,torchgpipe:gpipe"
    )
    parser.add_argument("--m", type=int, default=8, help="micro-batches M")
    parser.add_argument("--k", type=int, default=2, help="workers, all on cuda:0")
    parser.add_argument("--rounds", type=int, default=3, help="rotating rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    parser.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    parser.add_argument("--results", type=Path, default=None, help="markdown file to write to")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in JOBS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(JOBS)}")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
