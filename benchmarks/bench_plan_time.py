"""Planner validation: predicted step time (pipepar.planner.step_time) against measured.

For every layout this 2-core machine runs: two workers in one process (``pipepar.wrap``,
``threads=1``) and, with ``--ranks``, two gloo ranks (``pipepar.distributed.wrap``); every
schedule (gpipe, 1f1b, zb-h1 on 2 stages; interleaved-1f1b and zb-v on 4 stages, two per
worker); M = 4, 8, 16 micro-batches; recompute ``"except_last"`` and ``"never"``; for two
models: the MLP of ``bench_schedules.py`` (``_common.workload("mlp")``, MSE loss outside the
model) and the transformers GPT-2 of ``bench_models.py`` (``bench_models.job("gpt2")``, its
own loss from ``labels``). Equal stages as those benchmarks cut them.

Measured: per layout, the median step time (``pipe.step`` then gradients set to None, no
optimizer) with its p10-p90, over ``--steps`` timed steps split into ``--rounds`` blocks, each
block after one untimed step; the layouts of one model alternate, their order rotating from
round to round (``_common.run_blocks``), so a drift in the host's load hits all alike. On two
ranks every step starts after a barrier and its time is the slower rank's.

Predicted: :func:`pipepar.planner.step_time.predict_step` of the layout, from a profile per
model taken here before any timing, with :func:`pipepar.planner.cluster.measure_local` as the
cluster (the ranks' link measured by a gloo ping-pong between them), and with each runtime's
:class:`~pipepar.planner.runtime_fit.RuntimeFit`:

- the profile runs with one math thread (``torch.set_num_threads(1)``), as each stage's worker
  does with ``threads=1``; ``--profiles`` profiles are taken and each layer's forward and
  backward is the median over them;
- as the layout search and ``pipepar.wrap(model, sample=..., devices=N)`` do, it is of the
  whole batch with each layer's time per call and per row fitted against a second profile of
  one micro-batch of the largest M (:mod:`pipepar.planner.call_times`); predict_step adds
  recompute, the gradient sums over micro-batches at the measured memory bandwidth, and the
  measured hand-over latency and copy bandwidth per transfer;
- **the runtime's fit**: what the profile cannot see (two workers sharing the cores and, in
  one process, the interpreter; the runtime's work per action; checkpointing's bookkeeping)
  is fitted per model and runtime (:func:`pipepar.planner.calibrate.fit_runtime`: a scale, a
  time per F/B action and per layer of its stage, a recompute factor and time per recomputed
  layer, a hand-over time) to the measured medians of the five :data:`CALIBRATION` layouts
  (two micro-batch counts, two recomputing ones, two and four stages); every other layout is
  predicted from it, and the summary's errors count only those. The profile alone (no fit) is
  the next column.

What is left out shows as error: the loss outside the MLP, the optimizer (none here), and the
host's load moving between the fitted layouts and the others. The last column separates
compute from scheduling: the prediction's busy time of both workers (F + B + W + recompute)
against the CPU seconds the process spent per step, which a loaded host does not inflate as it
does wall time.

The table: layout, whether it is one the fit used, predicted ms, measured median ms (p10-p90),
error % ((predicted - measured) / measured), the profile alone's prediction and error, and
compute predicted against CPU time. Under it, per model and process count: the layout
predicted fastest, and whether it is the measured fastest or within 5% of it (where it is not
the measured fastest, the two are measured again head to head, alternating over ``--rematch``
rounds, and that decides); then the median and spread of each error over the layouts not used
for the fit.

    python benchmarks/bench_plan_time.py                       # 60 layouts, one process
    python benchmarks/bench_plan_time.py --ranks --steps 6     # also two gloo ranks
    python benchmarks/bench_plan_time.py --models mlp --schedules 1f1b,zb-v --chunks 8
    python benchmarks/bench_plan_time.py --quick               # seconds; CI smoke test
    python benchmarks/bench_plan_time.py --write               # the section in RESULTS.md
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core per thread, in every process
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import copy
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise, product
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipepar
from benchmarks import _common as common
from benchmarks import bench_models
from benchmarks._contenders import pipepar_balance
from benchmarks._procs import ProcessGroup
from benchmarks._results import markdown_table, record
from pipepar.core.named_schedules import NAMES as SCHEDULES
from pipepar.local import cpu_malloc
from pipepar.planner.calibrate import Measured, fit_runtime
from pipepar.planner.call_times import with_call_times
from pipepar.planner.cluster import Cluster, Link, measure_local
from pipepar.planner.model_profile import profile_model
from pipepar.planner.profile import Profile
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.planner.step_time import StepPrediction, predict_step

TITLE = "Planner: predicted against measured step time"
MODELS = ("mlp", "gpt2")
CHUNKS = (4, 8, 16)
CHECKPOINTS = ("except_last", "never")
WITHIN = 0.05  # the predicted best counts as right within 5% of the measured best
CALIBRATION = (  # schedule, M, recompute: the layouts each runtime's fit is made from
    ("1f1b", 4, "never"),
    ("1f1b", 16, "never"),
    ("1f1b", 8, "except_last"),
    ("1f1b", 16, "except_last"),
    ("interleaved-1f1b", 8, "never"),
)
LINK_ELEMENTS = (1, 1 << 20)  # float32 elements of the ranks' ping-pong: latency, bandwidth
QUICK = (  # model, schedule, M, recompute
    ("mlp", "1f1b", 4, "never"),
    ("mlp", "zb-v", 4, "except_last"),
    ("gpt2", "gpipe", 4, "except_last"),
)


# -- the jobs ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a model on this machine's two cores."""

    model: str
    """``"mlp"`` or ``"gpt2"``."""
    schedule: str
    """A name of :data:`pipepar.core.named_schedules.NAMES`."""
    chunks: int
    """Micro-batches M."""
    checkpoint: str
    """``"except_last"`` (recompute) or ``"never"``."""
    processes: int
    """1: two workers in this process; 2: two gloo ranks."""

    @property
    def key(self) -> str:
        """The layout's name in the table and in the process group."""
        where = "ranks" if self.processes == 2 else "threads"
        return f"{self.model} {where} {self.schedule} M={self.chunks} {self.checkpoint}"


@dataclass
class Model:
    """A model, its training step's inputs, and how its stages are cut."""

    name: str
    module: nn.Module
    step: Callable[[Any], None]
    """``step(pipe)``: one training step of a pipe of this model."""
    sample: Callable[[int], Any]
    """``sample(rows)``: the first ``rows`` rows of the batch, as :func:`profile` takes them."""
    batch: int
    """Rows in the batch."""
    description: str
    cuts: Callable[[int], dict[str, Any]]
    """``cuts(n_stages)``: the ``balance=`` or ``split=`` keyword of the wrap."""


def build(name: str, *, quick: bool) -> Model:
    """The benchmark's MLP (``bench_schedules.py``) or GPT-2 (``bench_models.py``)."""
    if name == "mlp":
        work = common.workload("mlp", quick=quick)
        x, y, loss = work.x, work.y, work.loss
        return Model(
            name,
            work.model,
            lambda pipe: pipe.step(x, y, loss),
            lambda rows: x[:rows],
            work.batch,
            work.description + ", MSE loss outside the model",
            lambda n: {"balance": pipepar_balance("gpipe", len(work.model), n)},
        )
    job = bench_models.job("gpt2", quick=quick)
    ids = job.ids
    return Model(
        name,
        job.model,
        lambda pipe: pipe.step(input_ids=ids, labels=ids),
        lambda rows: {"input_ids": ids[:rows], "labels": ids[:rows]},
        job.batch,
        job.description + ", its own loss",
        lambda n: {"split": bench_models.split(job, n)},
    )


def stages(schedule: str) -> int:
    """Stages on the two workers: 2, or 4 for the virtual-stage schedules."""
    return bench_models.stages(schedule)


def layouts(args: argparse.Namespace) -> list[Layout]:
    """Every layout of the run: --quick's few, else the product of all options."""
    procs = (1, 2) if args.ranks else (1,)
    every = list(product(args.models, args.schedules, args.chunks, CHECKPOINTS))
    chosen = QUICK if args.quick else every
    return [
        Layout(model=m, schedule=s, chunks=c, checkpoint=k, processes=p)
        for p in procs
        for m, s, c, k in chosen
        if m in args.models
    ]


def wrap(model: Model, layout: Layout) -> Any:
    """The layout's pipe in this process: two CPU workers, one math thread each."""
    return pipepar.wrap(
        copy.deepcopy(model.module),
        **model.cuts(stages(layout.schedule)),
        devices=["cpu", "cpu"],
        chunks=layout.chunks,
        schedule=layout.schedule,
        checkpoint=layout.checkpoint,
        threads=1,
    )


def _stepped(model: Model, pipe: Any) -> common.Step:
    def step() -> None:
        model.step(pipe)
        pipe.zero_grad(set_to_none=True)

    return step


def rank_builder(spec: dict[str, Any], rank: int, world: int) -> Callable[[str, int], common.Step]:
    """Factory run on every rank of a ProcessGroup: ``build(layout key, m) -> step``."""
    import pipepar.distributed as ppd

    cpu_malloc.tune()
    model = build(spec["model"], quick=spec["quick"])

    def make(key: str, m: int) -> common.Step:
        if key == "link":
            return _ping_pong(rank, m)
        _, _, schedule, _, checkpoint = key.split(" ")
        pipe = ppd.wrap(
            copy.deepcopy(model.module),
            **model.cuts(stages(schedule)),
            chunks=m,
            schedule=schedule,
            checkpoint=checkpoint,
        )
        return _stepped(model, pipe)

    return make


def _ping_pong(rank: int, elements: int) -> common.Step:
    """Rank 0 sends ``elements`` float32 to rank 1, which sends them back."""
    import torch.distributed as dist

    data = torch.zeros(elements)

    def step() -> None:
        if rank == 0:
            dist.send(data, 1)
            dist.recv(data, 1)
        else:
            dist.recv(data, 0)
            dist.send(data, 0)

    return step


def gloo_link(group: Any, block: int) -> Link:
    """The link between the two ranks, from ping-pong round trips (medians): latency half the
    small one's, bandwidth the large message's bytes over half the difference."""
    rtt = []
    for elements in LINK_ELEMENTS:
        answer = group.step_times("link", elements, max(block, 10), 2)
        if isinstance(answer, str):
            raise common.RemoteError(answer)
        rtt.append(statistics.median(answer))
    one_way = max(1e-9, (rtt[1] - rtt[0]) / 2)
    return Link(bandwidth=4 * LINK_ELEMENTS[1] / one_way, latency=rtt[0] / 2)


# -- predicting --------------------------------------------------------------------------------
def profile(model: Model, repeats: int, rows: int | None = None) -> Profile:
    """The model's profile with one math thread, each layer's times the median of
    ``repeats`` profiles; with ``rows``, of a batch of that many rows."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage's worker computes (threads=1)
    try:
        runs = [_profile_once(model, rows or model.batch) for _ in range(max(1, repeats))]
    finally:
        torch.set_num_threads(previous)
    layers = [
        dataclasses.replace(
            layer,
            forward_ms=statistics.median(r.layers[i].forward_ms or 0.0 for r in runs),
            backward_ms=statistics.median(r.layers[i].backward_ms or 0.0 for r in runs),
        )
        for i, layer in enumerate(runs[0].layers)
    ]
    return dataclasses.replace(runs[0], layers=layers)


def _profile_once(model: Model, rows: int) -> Profile:
    sample = model.sample(rows)
    if isinstance(model.module, nn.Sequential):
        return pipepar.profile(model.module, sample, device="cpu", optimizer=None)
    return profile_model(model.module, sample, device="cpu")


def balance(model: Model, prof: Profile, n_stages: int) -> list[int]:
    """The layout's layers per stage over the profile's layers (units for GPT-2)."""
    cut = model.cuts(n_stages)
    if "balance" in cut:
        return list(cut["balance"])
    names = [layer.name for layer in prof.layers]
    starts = [0, *(names.index(path) for path in cut["split"]), len(names)]
    return [b - a for a, b in pairwise(starts)]


def predict(
    model: Model, prof: Profile, layout: Layout, cluster: Cluster, fit: RuntimeFit | None
) -> StepPrediction:
    """The prediction of ``layout``'s step under the runtime's ``fit``."""
    return predict_step(
        prof,
        balance(model, prof, stages(layout.schedule)),
        cluster=cluster,
        schedule=layout.schedule,
        chunks=layout.chunks,
        checkpoint=layout.checkpoint,
        runtime=fit,
    )


# -- measuring ---------------------------------------------------------------------------------
Times = dict[str, list[float] | str]
"""Per layout key: the seconds of every timed step, or why it has none."""


def measure(
    model: Model, chosen: list[Layout], args: argparse.Namespace
) -> tuple[Times, dict[str, list[float]], Link | None]:
    """Every layout's step times (seconds), the in-process ones' CPU seconds per step, and
    the gloo link between the ranks (None without ranks)."""
    block = math.ceil(args.steps / args.rounds)
    timers: dict[str, common.Block] = {}
    skipped: dict[str, str] = {}
    cpu: dict[str, list[float]] = {}
    group = None
    if any(layout.processes == 2 for layout in chosen):
        spec = {"model": model.name, "quick": args.quick}
        group = ProcessGroup(2, "benchmarks.bench_plan_time:rank_builder", spec)
    pipes: list[Any] = []
    try:
        link = gloo_link(group, block) if group is not None else None
        for layout in chosen:
            if group is not None and layout.processes == 2:
                timers[layout.key] = common.remote_block(group, layout.key, layout.chunks, block, 1)
                continue
            try:
                pipes.append(wrap(model, layout))
                step = _stepped(model, pipes[-1])
                step()  # warm-up (and worker start)
            except Exception as error:
                skipped[layout.key] = common.why(error)
                continue
            timers[layout.key] = common.local_block(step, block, 1, cpu.setdefault(layout.key, []))
        times = common.run_blocks(timers, skipped, args.rounds, [x.key for x in chosen])
        return times, cpu, link
    finally:
        for pipe in pipes:
            getattr(pipe, "close", lambda: None)()
        if group is not None:
            group.close()


# -- predicting every layout -------------------------------------------------------------------
def two_point(model: Model, chosen: list[Layout], repeats: int) -> Profile:
    """The model's profile of the whole batch with call times fitted against a profile of one
    micro-batch of the largest M (as the search and ``wrap(sample=...)`` take it)."""
    whole = profile(model, repeats)
    rows_ = max(1, model.batch // max(x.chunks for x in chosen))
    if rows_ < whole.batch_size:
        whole = with_call_times(whole, profile(model, repeats, rows_))
    return whole


def calibrated(
    model: Model,
    prof: Profile,
    chosen: list[Layout],
    times: Times,
    clusters: dict[int, Cluster],
) -> dict[int, RuntimeFit]:
    """Per process count: the runtime fit (:func:`fit_runtime`) to the measured medians of
    the :data:`CALIBRATION` layouts among ``chosen`` (the identity where none ran)."""
    fits = {}
    for procs, cluster in clusters.items():
        runs = []
        for x in chosen:
            steps = times.get(x.key)
            if x.processes == procs and _calibration(x) and steps and not isinstance(steps, str):
                ms = 1e3 * statistics.median(steps)
                runs.append(Measured(balance(model, prof, stages(x.schedule)), x.schedule,
                                     x.chunks, x.checkpoint, ms))  # fmt: skip
        fits[procs] = fit_runtime(prof, runs, cluster=cluster) if runs else RuntimeFit()
    return fits


def _calibration(layout: Layout) -> bool:
    return (layout.schedule, layout.chunks, layout.checkpoint) in CALIBRATION


def predictions(
    model: Model,
    prof: Profile,
    chosen: list[Layout],
    clusters: dict[int, Cluster],
    fits: dict[int, RuntimeFit],
) -> dict[str, dict[str, float] | str]:
    """Per layout: the step and compute (ms) predicted with its runtime's fit, and without
    (``raw_``); or why there is none."""
    out: dict[str, dict[str, float] | str] = {}
    for x in chosen:
        cluster = clusters[x.processes]
        try:
            p = predict(model, prof, x, cluster, fits[x.processes])
            q = predict(model, prof, x, cluster, None)
        except ValueError as error:
            out[x.key] = common.why(error)
            continue
        out[x.key] = {
            "predicted_ms": p.step_ms,
            "predicted_busy_ms": sum(p.busy_ms),
            "raw_ms": q.step_ms,
        }
    return out


# -- report ------------------------------------------------------------------------------------
def rows(
    chosen: list[Layout],
    predicted: dict[str, dict[str, float] | str],
    times: Times,
    cpu: dict[str, list[float]],
) -> list[dict[str, Any]]:
    """One row per layout: predictions, measured quantiles (ms), errors (%)."""
    out = []
    for layout in chosen:
        row: dict[str, Any] = dataclasses.asdict(layout) | {"key": layout.key}
        row["calibration"] = _calibration(layout)
        pred, steps = predicted[layout.key], times[layout.key]
        if isinstance(pred, str) or isinstance(steps, str):
            out.append(row | {"error": pred if isinstance(pred, str) else steps, "steps": 0})
            continue
        q = common.Quantiles.of([1e3 * t for t in steps])
        row |= pred | {"error": None, "steps": len(steps)}
        row |= {"median_ms": q.median, "p10_ms": q.p10, "p90_ms": q.p90}
        row["error_pct"] = _off(pred["predicted_ms"], q.median)
        row["raw_error_pct"] = _off(pred["raw_ms"], q.median)
        used = cpu.get(layout.key)
        row["cpu_ms"] = 1e3 * statistics.median(used) if used else None
        row["busy_error_pct"] = _off(pred["predicted_busy_ms"], row["cpu_ms"]) if used else None
        out.append(row)
    return out


def _off(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def table(result: list[dict[str, Any]]) -> str:
    """The markdown table, one line per layout."""
    lines = []
    for r in result:
        head = [r["model"], r["processes"], r["schedule"], r["chunks"], r["checkpoint"]]
        head.append("fit" if r["calibration"] else "")
        if r["error"]:
            lines.append([*head, "-", r["error"], "-", "-", "-"])
            continue
        spread = f"{r['median_ms']:.1f} ({r['p10_ms']:.1f}-{r['p90_ms']:.1f})"
        raw = f"{r['raw_ms']:.1f} ({r['raw_error_pct']:+.0f}%)"
        busy = "-"
        if r["cpu_ms"] is not None:
            busy = f"{r['predicted_busy_ms']:.0f} / {r['cpu_ms']:.0f} ({r['busy_error_pct']:+.0f}%)"
        lines.append(
            [*head, f"{r['predicted_ms']:.1f}", spread, f"{r['error_pct']:+.0f}%", raw, busy]
        )
    headers = ["model", "processes", "schedule", "M", "recompute", "used for the fit"]
    headers += ["predicted ms", "measured ms median (p10-p90)", "error"]
    headers += ["profile alone ms (error)", "compute predicted / CPU measured ms (error)"]
    return markdown_table(headers, lines)


def best(result: list[dict[str, Any]], field: str = "predicted_ms") -> list[dict[str, Any]]:
    """Per model and process count: the layout predicted fastest (by ``field``) against the
    measured fastest; by their head-to-head medians (``rematch_ms``) where both have one."""
    out = []
    for model, procs in sorted({(r["model"], r["processes"]) for r in result}):
        mine = [r for r in result if (r["model"], r["processes"]) == (model, procs)]
        mine = [r for r in mine if not r["error"]]
        if not mine:
            continue
        guess = min(mine, key=lambda r: r[field])
        fact = min(mine, key=lambda r: r["median_ms"])
        rematched = bool(guess.get("rematch_ms") and fact.get("rematch_ms"))
        ms = "rematch_ms" if rematched else "median_ms"
        off = guess[ms] / fact[ms] - 1
        out.append(
            {"model": model, "processes": procs, "predicted": guess["key"],
             "measured": fact["key"], "slower": off, "right": off <= WITHIN,
             "rematched": rematched}
        )  # fmt: skip
    return out


def rematch(
    model: Model, chosen: list[Layout], result: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    """Where the layout predicted fastest (with the fit) is not the measured fastest, measure
    the two again head to head, alternating over ``--rematch`` rounds, and add each one's
    median (``rematch_ms``) to its row: one round's luck should not decide which is faster."""
    if not args.rematch:
        return
    block = math.ceil(args.steps / args.rounds)
    again = argparse.Namespace(**(vars(args) | {"rounds": args.rematch}))
    again.steps = args.rematch * block
    for b in best([r for r in result if r["model"] == model.name]):
        if b["predicted"] == b["measured"]:
            continue
        pair = [x for x in chosen if x.key in (b["predicted"], b["measured"])]
        times, _, _ = measure(model, pair, again)
        for r in result:
            steps = times.get(r["key"])
            if steps and not isinstance(steps, str):
                r["rematch_ms"] = 1e3 * statistics.median(steps)


def summary(result: list[dict[str, Any]], rounds: int = 0) -> str:
    """Under the table: the best-layout verdicts (``rounds``: of the head-to-head re-match)
    and the errors' median and spread."""
    lines = []
    for field, source in (("predicted_ms", "with the runtime's fit"), ("raw_ms", "profile alone")):
        for b in best(result, field):
            verdict = f"{b['slower']:+.1%} over it"
            if b["predicted"] == b["measured"]:
                verdict = "the measured best"
            elif b["rematched"]:
                verdict += f" when the two ran again head to head ({rounds} rounds)"
            ok = "right" if b["right"] else f"wrong (> {WITHIN:.0%})"
            lines.append(
                f"{b['model']}, {b['processes']} process(es), {source}: predicted best "
                f"{b['predicted']!r}, measured best {b['measured']!r}; the predicted best is "
                f"{verdict}: {ok}."
            )
    held_out = [r for r in result if not r["error"] and not r["calibration"]]
    for field, what in (
        ("error_pct", "step with the runtime's fit"),
        ("raw_error_pct", "step from the profile alone"),
        ("busy_error_pct", "compute (with the fit) against CPU time"),
    ):
        errors = [r[field] for r in held_out if r[field] is not None]
        if errors:
            q = common.Quantiles.of(errors)
            inside = sum(abs(e) <= 10 for e in errors)
            lines.append(
                f"Error of the {what}, {len(errors)} layouts not used for the fit: median "
                f"{q.median:+.0f}%, p10 {q.p10:+.0f}%, p90 {q.p90:+.0f}%, worst "
                f"{max(errors, key=abs):+.0f}%; {inside} within 10%."
            )
    return "\n".join(lines)


def fits_note(fits: dict[tuple[str, int], RuntimeFit], clusters: dict[int, Cluster]) -> str:
    """The fitted values and the links, one clause per model and runtime."""
    parts = []
    for (name, procs), fit in sorted(fits.items()):
        runtime = "one process" if procs == 1 else "two ranks"
        link = clusters[procs].intra
        parts.append(
            f"{name}, {runtime}: scale {fit.scale:.2f}, {fit.action_ms:.2f} ms per F/B action "
            f"+ {fit.layer_ms:.2f} per layer, recompute x{fit.recompute_scale:.2f} + "
            f"{fit.recompute_ms:.2f} ms per layer, hand-over +{fit.handover_ms:.2f} ms (fitted "
            f"to {fit.fitted_to}, worst {fit.worst_error:.0%}; link "
            f"{1e6 * link.latency:.0f} us, {link.bandwidth / 1e9:.1f} GB/s)"
        )
    return "; ".join(parts)


def notes(
    models: list[Model],
    cluster: Cluster,
    args: argparse.Namespace,
    before: str,
    fitted: str,
) -> str:
    block = math.ceil(args.steps / args.rounds)
    jobs = "; ".join(f"{m.name}: {m.description}" for m in models)
    calib = ", ".join(f"{s} M={m} {k}" for s, m, k in CALIBRATION)
    return (
        f"Jobs: {jobs}. Two CPU workers with one math thread each (one process), or two gloo "
        f"ranks; gradients set to None each step, no optimizer. {args.rounds} rounds x {block} "
        "timed steps per layout, each block after one untimed step, order rotating. "
        f"Predicted by predict_step from the median of {args.profiles} one-thread profiles "
        "per model (of the whole batch, call times fitted against one micro-batch of the "
        f"largest M), cluster {cluster.name!r} (hand-over {1e6 * cluster.intra.latency:.0f} "
        f"us, {cluster.intra.bandwidth / 1e9:.1f} GB/s, gradient sums at "
        f"{(cluster.memory_bandwidth or 0) / 1e9:.1f} GB/s; the ranks' link measured by a gloo "
        f"ping-pong), with each runtime's fit (pipepar.planner.calibrate.fit_runtime) to the "
        f"measured medians of {len(CALIBRATION)} layouts per model and runtime ({calib}; "
        f"marked 'fit'; the summary's errors leave them out): {fitted}. Compute: the "
        "prediction's busy time of both workers against the process's CPU time per step "
        "(median). Error = "
        f"(predicted - measured) / measured. Machine load before: {before}; after: "
        f"{common.load()}."
    )


def main(argv: list[str] | None = None) -> int:
    """Profile, measure, fit, predict, print the table; write it to RESULTS.md with --write."""
    args = _parse(argv)
    cpu_malloc.tune()
    torch.set_num_threads(1)
    before = common.load()
    cluster = measure_local(seconds=0.3 if args.quick else 1.0)
    chosen, result, models = layouts(args), [], []
    fits: dict[tuple[str, int], RuntimeFit] = {}
    clusters: dict[int, Cluster] = {1: cluster}
    for name in args.models:
        mine = [x for x in chosen if x.model == name]
        if not mine:
            continue
        model = build(name, quick=args.quick)
        models.append(model)
        prof = two_point(model, mine, args.profiles)
        times, cpu, link = measure(model, mine, args)
        if link is not None:
            clusters[2] = dataclasses.replace(cluster, name="gloo ranks", intra=link)
        mine_clusters = {p: clusters[p] for p in {x.processes for x in mine}}
        model_fits = calibrated(model, prof, mine, times, mine_clusters)
        fits |= {(name, p): f for p, f in model_fits.items()}
        found = rows(mine, predictions(model, prof, mine, mine_clusters, model_fits), times, cpu)
        rematch(model, mine, found, args)
        result += found
    note = notes(models, cluster, args, before, fits_note(fits, clusters))
    text, verdicts = table(result), summary(result, args.rematch)
    print(text, verdicts, note, sep="\n\n")
    if args.write:
        record(TITLE, text, notes="\n\n".join([verdicts, note]),
               path=common.results_path(args, "plan-time"))  # fmt: skip
    common.write_json(args.json, result)
    return 0


def _listed(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_options(parser, rounds=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    parser.add_argument("--profiles", type=int, default=3, help="profiles per model (median)")
    parser.add_argument("--ranks", action="store_true", help="also run on two gloo ranks")
    parser.add_argument(
        "--rematch",
        type=int,
        default=6,
        help="rounds of the head-to-head re-match where the predicted best is not the "
        "measured best (0: none)",
    )
    parser.add_argument("--write", action="store_true", help="write the section (--results)")
    parser.add_argument(
        "--models", type=_listed, default=list(MODELS), help="comma list of: mlp, gpt2"
    )
    parser.add_argument(
        "--schedules", type=_listed, default=list(SCHEDULES), help="comma list of schedules"
    )
    parser.add_argument(
        "--chunks", type=_listed, default=[str(m) for m in CHUNKS], help="comma list of M"
    )
    args = parser.parse_args(argv)
    for option, given, known in (
        ("models", args.models, MODELS),
        ("schedules", args.schedules, SCHEDULES),
        ("chunks", args.chunks, [str(m) for m in CHUNKS]),
    ):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"--{option}: unknown {unknown}; choose from {', '.join(known)}")
    args.chunks = [int(m) for m in args.chunks]
    if args.steps < 1 or args.rounds < 1 or args.profiles < 1 or args.rematch < 0:
        parser.error("--steps, --rounds and --profiles must be >= 1, --rematch >= 0")
    if args.quick:
        args.rounds, args.steps, args.profiles, args.rematch = 1, min(args.steps, 2), 1, 0
    return args


if __name__ == "__main__":
    raise SystemExit(main())
