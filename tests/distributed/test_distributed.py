"""pipepar.distributed on CPU: gloo ranks spawned on localhost, compared with one plain process.

Spawning is slow on 2 cores, so one pool of 4 worker processes (one gloo world) serves every
multi-process case; each case is a module-level function that runs on all 4 ranks and returns
what the parent asserts on. Cases that need fewer ranks use sub-groups of the world.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import socket
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipepar.distributed as ppd
from pipepar.core.named_schedules import NAMES, VIRTUAL
from pipepar.core.schedule import parse
from pipepar.distributed.stage import build_stage, load_local_state
from pipepar.ranks import replicas
from pipepar.ranks.arguments import check_schedule
from pipepar.ranks.mesh import build_mesh, check_grid
from pipepar.ranks.replicas import BUCKET_BYTES
from pipepar.ranks.transport import TensorMeta, decode_meta, encode_meta
from tests._ranks import context, settle

WORLD = 4
TOL = 1e-5
ROWS, CHUNKS, WIDTH = 8, 4, 6


# -- models and data shared by the parent and the workers ---------------------------------------
def tiny_model(seed: int = 1) -> nn.Sequential:
    """8 layers: 4 x (Linear(6, 6) + Tanh)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def batches(dp: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, inputs and targets of all replicas stacked: (dp, ROWS, WIDTH) each."""
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(dp, ROWS, WIDTH, generator=g), torch.randn(dp, ROWS, WIDTH, generator=g))
        for _ in range(steps)
    ]


BALANCE = {1: [8], 2: [3, 5], 4: [2, 2, 2, 2]}


# -- the pool -----------------------------------------------------------------------------------
def _serve(rank: int, port: int, tasks: Any, results: Any, env: dict[str, str]) -> None:
    settle(env)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(rank, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    """WORLD long-lived gloo ranks that run one case at a time."""

    def __init__(self) -> None:
        ctx = context()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tasks = [ctx.SimpleQueue() for _ in range(WORLD)]
        self.results = ctx.Queue()
        env = dict(os.environ)
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, port, self.tasks[r], self.results, env), daemon=True
            )
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        """Run ``fn(rank, *args)`` on every rank; return the values in rank order."""
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        for _ in range(WORLD):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(WORLD)) - set(out))} hung") from None
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{value}")
            out[rank] = value
        return [out[r] for r in range(WORLD)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def _subgroup(size: int) -> dist.ProcessGroup | None:
    """Split the world into consecutive groups of ``size`` ranks; return this rank's."""
    if size == WORLD:
        return None
    mine = None
    for start in range(0, WORLD, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = g
    return mine


# -- cases (run on every rank) ------------------------------------------------------------------
def ranks_per_pipeline(schedule: str, balance: list[int]) -> int:
    """pp: the number of stages, or half of it for the virtual-stage schedules."""
    return len(balance) // 2 if schedule in VIRTUAL else len(balance)


def case_matches_plain(
    rank: int, balance: list[int], dp: int, schedule: str, checkpoint: str
) -> dict:
    replicas.BUCKET_BYTES = 1  # a bucket per parameter: shows which ones went out early
    pp = ranks_per_pipeline(schedule, balance)
    pipe = ppd.wrap(
        tiny_model(),
        balance,
        chunks=CHUNKS,
        schedule=schedule,
        dp=dp,
        checkpoint=checkpoint,
        group=_subgroup(pp * dp),
    )
    plain = tiny_model()
    mine = list(pipe.parameters())  # none on a rank of Tanh stages only: it still takes part
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (mine, plain.parameters()) if ps]
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x, y in batches(dp, steps=2):
        loss = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        ref = nn.functional.mse_loss(plain(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH))
        ref.backward()
        ref_grads = dict(plain.named_parameters())
        errors["loss"] = max(errors["loss"], abs(loss - ref.item()))
        for name, p in pipe.named_parameters():
            errors["grad"] = max(errors["grad"], (p.grad - ref_grads[name].grad).abs().max().item())
        for opt in opts:
            opt.step(), opt.zero_grad()
    ref_state = plain.state_dict()
    for name, t in pipe.state_dict().items():
        errors["param"] = max(errors["param"], (t - ref_state[name]).abs().max().item())
    sync = pipe.compute._sync
    result = {
        "errors": errors,
        "keys": sorted(pipe.state_dict()),
        "full_keys": list(pipe.full_state_dict()),
        "stage": pipe.stage_index,
        "stages": pipe.stages,
        "overlap": (sync.posted_early, sync.posted_before_finish, len(sync.buckets)),
    }
    pipe.close()
    replicas.BUCKET_BYTES = BUCKET_BYTES
    return result


def case_state_dict(rank: int) -> dict:
    plain = tiny_model()
    with torch.device("meta"):
        meta = tiny_model()
    loaded = ppd.wrap(meta, BALANCE[2], chunks=2, dp=2, state_dict=plain.state_dict())
    full = loaded.full_state_dict()
    shifted = {k: v + 1 for k, v in plain.state_dict().items()}
    loaded.load_state_dict(shifted)
    after_load = {k: (v - shifted[k]).abs().max().item() for k, v in loaded.state_dict().items()}
    with torch.device("meta"):
        unset = tiny_model()
    torch.manual_seed(100 + rank)  # replicas would initialise differently without the broadcast
    fresh = ppd.wrap(unset, BALANCE[2], chunks=2, dp=2)
    mine = torch.cat([p.detach().flatten() for p in fresh.parameters()])
    copies = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(copies, mine)
    for pipe in (loaded, fresh):
        pipe.close()
    return {
        "full": full,
        "full_keys": list(full),
        "full_error": max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
        "local_keys": list(loaded.state_dict()),
        "after_load": after_load,
        "stage": loaded.stage_index,
        "same_as_replica": torch.equal(copies[rank], copies[rank ^ 2]),  # rank r and r+-2
        "differs_from_plain": all(
            not torch.equal(v, plain.state_dict()[k]) for k, v in fresh.named_parameters()
        ),
    }


class _SavedBytes:
    """Bytes of tensors autograd holds for backward, now and at peak (saved_tensors_hooks)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        return _Held(self, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.t


class _Held:
    def __init__(self, meter: _SavedBytes, t: torch.Tensor) -> None:
        # a detached alias: holding the saved tensor itself (an output refers to its grad_fn)
        # would make a reference cycle through the graph that keeps it alive
        self.meter, self.t, self.n = meter, t.detach(), t.numel() * t.element_size()
        meter.now += self.n
        meter.peak = max(meter.peak, meter.now)

    def __del__(self) -> None:
        self.meter.now -= self.n


class _Draws(nn.Module):
    """Draws random numbers three ways: functional dropout, a rand_like mask, SDPA dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.dropout(x, 0.3) * (torch.rand_like(x) > 0.2)
        q = x.view(x.shape[0], 1, 2, WIDTH // 2)
        att = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
        return att.reshape(x.shape)


def case_random_replay(rank: int, schedule: str) -> dict:
    """Loss and gradients of checkpointed runs equal the run that keeps its activations."""
    balance = [2, 2, 2, 2] if schedule == "zb-v" else [4, 4]
    runs = {}
    for checkpoint in ("never", "always", "except_last"):
        torch.manual_seed(5)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), _Draws())])
        pipe = ppd.wrap(
            model, balance, chunks=CHUNKS, schedule=schedule, checkpoint=checkpoint,
            group=_subgroup(2),
        )  # fmt: skip
        torch.manual_seed(6 + rank)  # each rank's own generator, the same in every run
        x, y = batches(1, 1)[0]
        loss = pipe.step(x[0], y[0], nn.functional.mse_loss)
        runs[checkpoint] = (loss, [p.grad.clone() for p in pipe.parameters()])
        pipe.close()
    ref_loss, ref_grads = runs["never"]
    same = all(
        loss == ref_loss and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        for loss, grads in runs.values()
    )
    return {"same": same, "loss": ref_loss}


class _Fork(nn.Module):
    """x -> (h, 2h, step count): a tuple with a non-float member crosses stage boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, v: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if isinstance(v, torch.Tensor):
            h = self.linear(v)
            return h, 2 * h, torch.ones(v.shape[0], dtype=torch.long)
        a, b, n = v
        return self.linear(a) + b, b, n + 1


class _Join(nn.Module):
    def forward(self, v: tuple[torch.Tensor, ...]) -> torch.Tensor:
        a, b, n = v
        return a * b + n.unsqueeze(1)


def _forked_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(_Fork(), _Fork(), _Fork(), _Join())


def case_tuples(rank: int, schedule: str) -> dict:
    """Tuples (float and integer tensors) between stages, local and remote hand-offs."""
    balance = [1, 1, 1, 1] if schedule == "zb-v" else [2, 2]
    pipe = ppd.wrap(_forked_model(), balance, chunks=CHUNKS, schedule=schedule, group=_subgroup(2))
    plain = _forked_model()
    x, y = batches(1, 1)[0]
    loss = pipe.step(x[0], y[0], nn.functional.mse_loss)
    ref = nn.functional.mse_loss(plain(x[0]), y[0])
    ref.backward()
    grads = dict(plain.named_parameters())
    error = max((p.grad - grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    pipe.close()
    return {"loss": abs(loss - ref.item()), "grad": error}


def case_short_batches(rank: int, schedule: str) -> dict:
    """Batches of fewer rows than chunks run fewer micro-batches (then a full one again), each
    with the plain model's loss and gradients, ignored targets included; an empty one fails
    with a ValueError on the rank that holds it."""
    balance = [2, 2, 2, 2] if schedule == "zb-v" else [4, 4]
    pipe = ppd.wrap(tiny_model(), balance, chunks=CHUNKS, schedule=schedule, group=_subgroup(2))
    plain = tiny_model()
    errors = []
    for rows in (3, 1, ROWS):
        x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
        y = torch.arange(rows) % WIDTH
        y[1:2] = -100
        loss = pipe.step(x, y, nn.functional.cross_entropy)
        ref = nn.functional.cross_entropy(plain(x), y)
        ref.backward()
        grads = dict(plain.named_parameters())
        error = max((p.grad - grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
        errors.append(max(error, abs(loss - ref.item())))
    for norm_type in (2.0, float("inf")):  # clipped by the whole model's norm, as the plain one
        norm = pipe.clip_grad_norm_(0.05, norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
        grads = dict(plain.named_parameters())
        error = max((p.grad - grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
        errors.append(max(error, abs(norm.item() - ref_norm.item())))
    empty = ""
    if rank in (0, 1):
        try:
            nothing = torch.zeros(0, WIDTH)
            pipe.step(nothing, nothing, nn.functional.mse_loss)
        except Exception as e:  # the error itself is what is checked
            empty = f"{type(e).__name__}: {e}"
    pipe.close()
    return {"errors": errors, "empty": empty}


def case_mixed_calls(rank: int) -> str:
    """The ranks of a pipeline disagree: stage 0 trains while stage 1 evaluates."""
    pipe = ppd.wrap(tiny_model(), [4, 4], chunks=CHUNKS, group=_subgroup(2), timeout=30)
    x, y = batches(1, 1)[0]
    evaluating = rank % 2 == 1
    try:
        with torch.set_grad_enabled(not evaluating):
            pipe.step(x[0], y[0], nn.functional.mse_loss)
    except Exception as e:  # the error itself is what is checked
        return f"{type(e).__name__}: {e}"
    finally:
        pipe.close()
    return "no error"


def case_memory(rank: int, m: int) -> dict:
    """Peak saved-activation bytes of each stage for GPipe, 1F1B and ZB-H1, pp=4, no
    checkpointing."""
    width = 64
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)])
    x, y = torch.randn(4 * m, width), torch.randn(4 * m, width)
    peaks = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = ppd.wrap(model, [1, 1, 1, 1], chunks=m, schedule=schedule, checkpoint="never")
        meter = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            pipe.step(x, y, nn.functional.mse_loss)
        peaks[schedule] = (meter.peak, meter.now)
        pipe.close()
    return {"stage": rank, "peaks": peaks}


def _full_collections_during(fn: Callable[[], None]) -> int:
    """How many full collections ``fn`` runs (the automatic collector held off meanwhile)."""
    count = [0]

    def seen(phase: str, info: dict) -> None:
        count[0] += phase == "start" and info["generation"] == 2

    gc.disable()
    gc.callbacks.append(seen)
    try:
        fn()
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    return count[0]


def case_mesh_close(rank: int) -> dict:
    """A mesh's close frees its groups; it collects garbage only when a cycle still holds one."""
    out = {}
    for label in ("plain", "cycle"):
        mesh = build_mesh(WORLD, 1, group=None, timeout=None)
        ref = weakref.ref(mesh.fwd)
        if label == "cycle":
            loop: list[object] = [mesh.fwd]
            loop.append(loop)
            del loop
        out[label] = (_full_collections_during(mesh.close), ref() is None)
    return out


def case_bad_arguments(rank: int) -> dict:
    """Mismatched grids raise on every rank without creating any group or sending anything."""
    before = dist.distributed_c10d._world.group_count
    messages = {}
    for label, kwargs in {
        "world": {"balance": [2, 2, 2, 2], "dp": 2},
        "dp": {"balance": [4, 4], "dp": 0},
        "balance": {"balance": [4, 3], "dp": 2},
        "schedule": {"balance": [4, 4], "dp": 2, "schedule": "zigzag"},
        "custom schedule": {
            "balance": [4, 4],
            "dp": 2,
            "chunks": 2,
            "schedule": parse("F0 F1 B1 B0 | F0 F1 B0 B1"),
        },
        "virtual": {"balance": [2, 2, 2, 2], "dp": 1, "schedule": "zb-v"},
        "odd virtual": {"balance": [3, 3, 2], "dp": 1, "schedule": "interleaved-1f1b"},
    }.items():
        try:
            ppd.wrap(tiny_model(), **kwargs)
        except (ValueError, TypeError) as e:
            messages[label] = str(e)
    return {
        "messages": messages,
        "groups_created": dist.distributed_c10d._world.group_count - before,
    }


class _Boom(nn.Module):
    """Raises in forward once ``armed`` is set on the rank named ``where``."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("boom")
        return x


def case_failure(rank: int, timeout: float) -> dict:
    """Stage 1 of replica 0 (rank 1) raises in its second step; every rank must end in error."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Boom(), nn.Linear(WIDTH, WIDTH))
    pipe = ppd.wrap(model, [2, 2], chunks=2, schedule="1f1b", dp=2, timeout=timeout)
    x, y = batches(2, 1)[0]
    pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
    _Boom.armed = rank == 1
    start = time.monotonic()
    try:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        outcome = "no error"
    except ppd.PipelineError as e:
        outcome = str(e)
    finally:
        _Boom.armed = False
    elapsed = time.monotonic() - start
    try:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        again = "no error"
    except ppd.PipelineError as e:
        again = str(e)
    dist.barrier()  # the world group outlives the pipeline's groups
    return {"outcome": outcome, "elapsed": elapsed, "again": again}


def case_hang(rank: int, timeout: float) -> dict:
    """Stage 0 of each 2-rank pipeline stalls past the timeout; stage 1 must give up in time."""
    pipe = ppd.wrap(tiny_model(), BALANCE[2], chunks=2, group=_subgroup(2), timeout=timeout)
    x, y = batches(1, 1)[0]
    if pipe.stage_index == 0:
        time.sleep(2 * timeout)
    start = time.monotonic()
    try:
        pipe.step(x[0], y[0], nn.functional.mse_loss)
        outcome = "no error"
    except ppd.PipelineError as e:
        outcome = str(e)
    return {"stage": pipe.stage_index, "outcome": outcome, "elapsed": time.monotonic() - start}


def case_debug_log(rank: int) -> list[str]:
    """PIPEPAR_DEBUG=1 logs every send and receive."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("pipepar").addHandler(handler)
    os.environ["PIPEPAR_DEBUG"] = "1"
    try:
        pipe = ppd.wrap(tiny_model(), BALANCE[4], chunks=3, schedule="1f1b")
        x, y = batches(1, 1)[0]
        pipe.step(x[0], y[0], nn.functional.mse_loss)
        pipe.close()
    finally:
        del os.environ["PIPEPAR_DEBUG"]
        logging.getLogger("pipepar").removeHandler(handler)
    return records


def case_pipe_under_ddp(rank: int, checkpoint: str) -> dict:
    """A single-process pipepar.wrap pipeline per rank, replicas kept in sync by DDP (2 x 2)."""
    from torch.nn.parallel import DistributedDataParallel

    import pipepar

    group = _subgroup(2)
    pipe = pipepar.wrap(
        tiny_model(), [3, 5], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint=checkpoint
    )
    ddp = DistributedDataParallel(pipe, process_group=group)
    plain = tiny_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    worst = 0.0
    for x, y in batches(2, steps=2):
        me = dist.get_rank(group)
        nn.functional.mse_loss(ddp(x[me]), y[me]).backward()
        nn.functional.mse_loss(plain(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH)).backward()
        ref = dict(plain.named_parameters())
        for name, p in pipe.named_parameters():
            worst = max(worst, (p.grad - ref[name].grad).abs().max().item())
        opt.step(), plain_opt.step(), opt.zero_grad(), plain_opt.zero_grad()
    pipe.close()
    return {"grad_error": worst, "n_params": len(list(pipe.parameters()))}


def dropout_model() -> nn.Sequential:
    """8 layers: 4 x (Linear(6, 6) + Dropout(0.5)); eval mode must switch the dropout off."""
    torch.manual_seed(1)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Dropout())])


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of 2 replicas (2, ROWS, WIDTH) and class targets, -100 on most rows: replicas and
    micro-batches hold different numbers of real targets, some none."""
    x = torch.randn(2, ROWS, WIDTH, generator=torch.Generator().manual_seed(5))
    y = torch.full((2, ROWS), -100)
    y[0, [0, 4, 5]], y[1, 7] = torch.tensor([1, 2, 3]), 5
    return x, y


def case_evaluation(rank: int, schedule: str, balance: list[int]) -> dict:
    """Two replicas validate under no_grad (step, then pipe(x)), then train on the same batch."""
    pipe = ppd.wrap(dropout_model(), balance, chunks=CHUNKS, schedule=schedule, dp=2).eval()
    x, y = (t[pipe.dp_rank] for t in eval_batch())
    seen: list[bool] = []
    hooks = [
        layer.register_forward_hook(
            lambda m, a, out: seen.append(torch.is_grad_enabled() or out.requires_grad)
        )
        for layer in pipe.children()
    ]
    with torch.no_grad():
        loss, out = pipe.step(x, y, nn.functional.cross_entropy), pipe(x)
    with torch.inference_mode():
        loss_inference = pipe.step(x, y, nn.functional.cross_entropy)
    for h in hooks:
        h.remove()
    untouched = all(p.grad is None for p in pipe.parameters())
    try:
        pipe(x)
        refused = ""
    except TypeError as e:
        refused = str(e)
    loss_train = pipe.step(x, y, nn.functional.cross_entropy)  # eval mode still: no dropout
    result = {
        "loss": loss,
        "loss_inference": loss_inference,
        "out": out,
        "last": len(balance) - 1 in pipe.stages,
        "replica": pipe.dp_rank,
        "no_graph": bool(seen) and not any(seen),
        "untouched": untouched,
        "refused": refused,
        "loss_train": loss_train,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
    }
    pipe.close()
    return result


# -- tests: multi-process -----------------------------------------------------------------------
GRIDS = [  # (balance, dp, schedule, checkpoint); pp = len(balance), or half of it if virtual
    # every schedule on 2 ranks per pipeline, recomputing never and always, with and without dp
    ([3, 5], 2, "gpipe", "never"),
    ([3, 5], 1, "gpipe", "always"),
    ([3, 5], 2, "1f1b", "except_last"),
    ([3, 5], 1, "1f1b", "never"),
    ([3, 5], 1, "1f1b", "always"),
    ([3, 5], 2, "zb-h1", "never"),
    ([3, 5], 2, "zb-h1", "always"),
    ([3, 5], 1, "zb-h1", "except_last"),
    ([2, 2, 2, 2], 2, "zb-v", "never"),
    ([2, 2, 2, 2], 1, "zb-v", "except_last"),
    ([1, 2, 3, 2], 1, "zb-v", "always"),
    ([2, 2, 2, 2], 2, "interleaved-1f1b", "always"),
    ([1, 3, 2, 2], 1, "interleaved-1f1b", "never"),
    ([2, 2, 2, 2], 1, "interleaved-1f1b", "except_last"),
    ([2, 2, 2, 2], 1, "v-half", "never"),
    ([1, 2, 3, 2], 1, "v-half", "always"),
    ([2, 2, 2, 2], 2, "v-min", "always"),
    ([1, 3, 2, 2], 1, "v-min", "never"),
    # 4 ranks per pipeline: the V and the loop reach every rank (rank 3 sends to rank 0)
    ([2, 2, 2, 2], 1, "gpipe", "always"),
    ([2, 2, 2, 2], 1, "1f1b", "never"),
    ([1] * 8, 1, "zb-v", "never"),
    ([1] * 8, 1, "interleaved-1f1b", "always"),
    # 1 rank per pipeline, 2 replicas; with zb-v that rank runs both stages
    ([8], 2, "gpipe", "always"),
    ([8], 2, "1f1b", "except_last"),
    ([4, 4], 2, "zb-v", "always"),
]


def test_the_grid_runs_every_schedule_on_2_ranks_recomputing_never_and_always() -> None:
    for name in NAMES:
        modes = {c for b, _, s, c in GRIDS if s == name and ranks_per_pipeline(s, b) == 2}
        assert {"never", "always"} <= modes, name
    assert any(dp == 2 and ranks_per_pipeline(s, b) == 2 for b, dp, s, _ in GRIDS)


def _expected_stages(schedule: str, pp: int, position: int) -> list[int]:
    if schedule in ("zb-v", "v-half", "v-min"):
        return [position, 2 * pp - 1 - position]
    if schedule == "interleaved-1f1b":
        return [position, position + pp]
    return [position]


@pytest.mark.slow
@pytest.mark.parametrize(("balance", "dp", "schedule", "checkpoint"), GRIDS)
def test_training_matches_one_plain_process(
    pool: Pool, balance: list[int], dp: int, schedule: str, checkpoint: str
) -> None:
    results = pool.run(case_matches_plain, balance, dp, schedule, checkpoint)
    pp = ranks_per_pipeline(schedule, balance)
    plain = tiny_model().state_dict()
    for r in results:
        assert r["errors"]["loss"] < TOL, r
        assert r["errors"]["grad"] < TOL, r
        assert r["errors"]["param"] < TOL, r
        assert r["full_keys"] == list(plain)  # gathered in the model's order
        # each rank holds its stages' layers under their original names, nothing else
        assert r["stages"] == _expected_stages(schedule, pp, r["stage"]), r
        layers = {i for s in r["stages"] for i in range(sum(balance[:s]), sum(balance[: s + 1]))}
        assert set(r["keys"]) == {k for k in plain if int(k.split(".")[0]) in layers}
        early, before_finish, n_buckets = r["overlap"]
        if dp > 1:  # every bucket was posted as soon as its stage's gradients were final
            assert before_finish == n_buckets == len(r["keys"]), r
            # Posted while the rank still computed: parameters' sums go out as the last backward
            # makes them, and a rank's later stage's while its earlier stage runs.
            assert early > 0, r
    assert {r["stage"] for r in results} == set(range(pp))


@pytest.mark.slow
def test_ranks_that_make_different_calls_fail_at_once_saying_so(pool: Pool) -> None:
    start = time.monotonic()
    for message in pool.run(case_mixed_calls):
        assert "called for an evaluation but the rank of stage 0 for a training step" in message
        assert "every rank of a pipeline must make the same call" in message, message
    assert time.monotonic() - start < 25  # well before the timeout: the header tells at once


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_batches_shorter_than_chunks_run_fewer_micro_batches(pool: Pool, schedule: str) -> None:
    results = pool.run(case_short_batches, schedule)
    for r in results[:2]:
        assert max(r["errors"]) < TOL, r
        assert "ValueError" in r["empty"] and "no rows" in r["empty"], r


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_tuples_cross_ranks_and_local_hand_offs(pool: Pool, schedule: str) -> None:
    for r in pool.run(case_tuples, schedule):
        # float32 gradients summed in another order over the hand-offs: 1.1e-5 seen here
        assert r["loss"] < TOL and r["grad"] < 3 * TOL, r


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_recompute_replays_every_random_draw_across_ranks(pool: Pool, schedule: str) -> None:
    for r in pool.run(case_random_replay, schedule):
        assert r["same"], r
        assert r["loss"] > 0


@pytest.mark.slow
def test_state_dicts_use_the_original_keys_and_gather_the_whole_model(pool: Pool) -> None:
    plain = tiny_model().state_dict()
    results = pool.run(case_state_dict)
    for rank, r in enumerate(results):
        assert r["full_keys"] == list(plain)
        assert r["full_error"] == 0.0
        start, stop = (0, 3) if r["stage"] == 0 else (3, 8)
        assert r["local_keys"] == [k for k in plain if start <= int(k.split(".")[0]) < stop]
        assert max(r["after_load"].values()) == 0.0
        assert r["same_as_replica"], f"rank {rank}: replicas were initialised differently"
        assert r["differs_from_plain"], f"rank {rank}: reset_parameters did not run"
    # the gathered checkpoint loads into a single-process pipeline and into the plain model
    import pipepar

    full = {k: v + 0.5 for k, v in results[0]["full"].items()}
    single = pipepar.wrap(tiny_model(seed=7), [4, 4], devices=["cpu", "cpu"], chunks=2)
    single.load_state_dict(full)
    again = tiny_model(seed=7)
    again.load_state_dict(single.state_dict())
    assert all(torch.equal(v, full[k]) for k, v in again.state_dict().items())
    single.close()


@pytest.mark.slow
def test_1f1b_holds_fewer_activations_than_gpipe_and_zb_h1_no_more_than_1f1b(pool: Pool) -> None:
    m = 8
    for r in pool.run(case_memory, m):
        j = r["stage"]
        gpipe_peak, gpipe_left = r["peaks"]["gpipe"]
        ofob_peak, ofob_left = r["peaks"]["1f1b"]
        zb_peak, zb_left = r["peaks"]["zb-h1"]
        assert gpipe_left == ofob_left == zb_left == 0  # all saved was released after backward
        per_microbatch = gpipe_peak / m
        assert per_microbatch > 0
        assert ofob_peak == pytest.approx((4 - j) * per_microbatch), (j, r["peaks"])
        assert 0 < zb_peak <= ofob_peak, (j, r["peaks"])


def test_closing_a_mesh_frees_its_groups_collecting_only_for_a_cycle(pool: Pool) -> None:
    for r in pool.run(case_mesh_close):
        assert r == {"plain": (0, True), "cycle": (1, True)}, r


@pytest.mark.slow
def test_bad_grids_fail_on_every_rank_before_any_group_is_created(pool: Pool) -> None:
    for r in pool.run(case_bad_arguments):
        assert r["groups_created"] == 0
        msg = r["messages"]
        assert "needs 8 ranks, but the process group has 4; pass dp=1" in msg["world"]
        assert "dp must be at least 1" in msg["dp"]
        assert "sums to 7 but the model has 8 layers" in msg["balance"]
        assert "'zigzag'" in msg["schedule"]
        assert "same order" in msg["custom schedule"]
        assert (
            "balance has 4 stages on 2 ranks per pipeline and dp=1, so the grid needs 2 ranks, "
            "but the process group has 4; pass dp=2"
        ) in msg["virtual"]
        assert "runs 2 stages per rank, but balance has 3 stages" in msg["odd virtual"]


@pytest.mark.slow
def test_a_failing_rank_ends_every_rank_with_its_error(pool: Pool) -> None:
    timeout = 20.0
    results = pool.run(case_failure, timeout)
    report = (
        "rank 1 (stage 1, replica 0) failed in the forward of micro-batch 0: RuntimeError: boom"
    )
    for rank, r in enumerate(results):
        assert report in r["outcome"], (rank, r)
        assert r["elapsed"] < timeout, (rank, r)
        assert report in r["again"], (rank, r)
        assert "the pipeline is closed" in r["again"], (rank, r)


@pytest.mark.slow
def test_a_stalled_rank_ends_its_peers_within_the_timeout(pool: Pool) -> None:
    timeout = 1.5
    for r in pool.run(case_hang, timeout):
        assert "StallError: receiving the header from rank" in r["outcome"], r
        assert "no answer within timeout=1.5 s" in r["outcome"], r
        if r["stage"] == 1:  # it named the stalled peer and gave up after about the timeout
            assert timeout * 0.9 < r["elapsed"] < timeout + 5, r


@pytest.mark.slow
def test_pipepar_debug_logs_every_send_and_receive(pool: Pool) -> None:
    for stage, records in enumerate(pool.run(case_debug_log)):
        sends = [m for m in records if "send activation" in m]
        recvs = [m for m in records if "recv gradient" in m]
        assert len(sends) == (3 if stage < 3 else 0), records
        assert len(recvs) == (3 if stage < 3 else 0), records
        assert len([m for m in records if "recv activation" in m]) == (3 if stage > 0 else 0)
        assert len([m for m in records if "send gradient" in m]) == (3 if stage > 0 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_single_process_pipes_compose_with_ddp(pool: Pool, checkpoint: str) -> None:
    n_params = len(list(tiny_model().parameters()))
    for r in pool.run(case_pipe_under_ddp, checkpoint):
        assert r["n_params"] == n_params
        assert r["grad_error"] < TOL, r


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "balance"), [("1f1b", [3, 5]), ("zb-v", [2, 2, 2, 2])])
def test_evaluation_runs_forwards_only_and_gives_the_output_on_the_last_stage(
    pool: Pool, schedule: str, balance: list[int]
) -> None:
    plain = dropout_model().eval()
    x, y = eval_batch()
    expected = nn.functional.cross_entropy(plain(x.reshape(-1, WIDTH)), y.reshape(-1))
    expected.backward()  # the training step after the evaluation must find these gradients
    grads = dict(plain.named_parameters())
    for r in pool.run(case_evaluation, schedule, balance):
        # the loss of both replicas' batches, as step joins it, on every rank
        assert abs(r["loss"] - expected.item()) <= TOL * expected.item(), r
        assert r["loss_inference"] == r["loss"]
        assert r["no_graph"], "a stage built an autograd graph during evaluation"
        assert r["untouched"], "evaluation wrote .grad"
        assert "under torch.no_grad()" in r["refused"]
        if r["last"]:
            logits = plain(x[r["replica"]]).detach()
            torch.testing.assert_close(r["out"], logits, rtol=TOL, atol=1e-7)
        else:
            assert r["out"] is None
        assert abs(r["loss_train"] - expected.item()) <= TOL * expected.item()
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, grads[name].grad, rtol=TOL, atol=1e-7)


def _nccl_worker(rank: int, port: int, out: Any) -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    pipe = ppd.wrap(tiny_model(), BALANCE[2], chunks=CHUNKS, schedule="1f1b")
    plain = tiny_model().cuda(rank)
    x, y = (t[0].cuda(rank) for t in batches(1, 1)[0])
    loss = pipe.step(x, y, nn.functional.mse_loss)
    ref = nn.functional.mse_loss(plain(x), y)
    ref.backward()
    grads = dict(plain.named_parameters())
    err = max((p.grad - grads[k].grad).abs().max().item() for k, p in pipe.named_parameters())
    out.put((rank, abs(loss - ref.item()), err, str(pipe.device)))
    pipe.close()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_pipeline_on_two_gpus_matches_plain() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_worker, args=(port, out), nprocs=2)
    for rank, loss_err, grad_err, device in sorted(out.get() for _ in range(2)):
        assert device == f"cuda:{rank}"
        assert loss_err < TOL and grad_err < TOL


# -- tests: no process group --------------------------------------------------------------------
def test_check_grid_names_both_sizes_and_a_fix() -> None:
    assert check_grid(6, 3, 2) == 2
    with pytest.raises(ValueError, match="needs 4 ranks, but the process group has 6; pass dp=3"):
        check_grid(6, 2, 2)
    with pytest.raises(ValueError, match="divides 5"):
        check_grid(5, 2, 2)
    with pytest.raises(TypeError, match="dp must be an int"):
        check_grid(4, 2, 2.0)
    assert check_grid(4, 2, 2, n_stages=4) == 2  # virtual stages: 2 per rank
    with pytest.raises(ValueError, match="2 stages per rank over a number of ranks that divides 6"):
        check_grid(6, 4, 1, n_stages=8)


def test_every_schedule_name_is_accepted_with_ranks_per_pipeline_from_the_balance() -> None:
    assert list(ppd.SCHEDULES) == list(NAMES)
    for name in NAMES:
        balance = [2, 2, 2, 2] if name in VIRTUAL else [4, 4]
        schedule = check_schedule(name, len(balance), CHUNKS)
        assert schedule.n_workers == 2, name
        assert schedule.n_stages == len(balance)


def test_the_handshake_tells_apart_schedules_that_order_a_rank_differently() -> None:
    from pipepar.ranks.handshake import fingerprint

    def schedule_of(*workers: str) -> str:
        return fingerprint(
            tiny_model(), [2, 2, 2, 2], chunks=1, schedule=parse(workers, name="custom"),
            dp=1, checkpoint="never", state_dict=None,
        )["schedule"]  # fmt: skip

    # the same order within every stage, but worker 0 runs its two stages' actions differently
    one = schedule_of("0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0")
    other = schedule_of("0F0 3F0 0B0 3B0", "1F0 2F0 2B0 1B0")
    assert one != other
    assert one == schedule_of("0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0")


def test_build_stage_keeps_local_layers_under_original_names() -> None:
    with torch.device("meta"):
        model = tiny_model()
    part = build_stage(model, [3, 5], 1, device=torch.device("cpu"))
    assert list(part._modules) == ["3", "4", "5", "6", "7"]
    assert list(part.state_dict()) == ["4.weight", "4.bias", "6.weight", "6.bias"]
    assert all(not p.is_meta for p in part.parameters())
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in part.parameters())
    assert all(p.is_meta for p in model[0].parameters())  # other stages stay unallocated


def test_build_stage_loads_a_whole_model_state_dict() -> None:
    plain = tiny_model()
    with torch.device("meta"):
        model = tiny_model()
    part = build_stage(model, [3, 5], 0, device=torch.device("cpu"), state_dict=plain.state_dict())
    for k, v in part.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k])
    with pytest.raises(
        ValueError, match=r"lacks 3 key\(s\) of this stage, e.g. \[.0.bias., .2.weight"
    ):
        load_local_state(part, {"0.weight": plain[0].weight})


def test_meta_layers_without_reset_parameters_need_a_state_dict() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Scale())
    with pytest.raises(ValueError, match=r"layer 1 is on the meta device .*\['Scale'\]"):
        build_stage(model, [1, 1], 1, device=torch.device("cpu"))
    part = build_stage(
        model, [1, 1], 1, device=torch.device("cpu"), state_dict={"1.s": torch.tensor([3.0])}
    )
    assert part[0].s.item() == 3.0


def test_gradient_buckets_run_from_the_last_layer_and_split_by_size() -> None:
    from pipepar.ranks.replicas import _buckets

    model = tiny_model()  # 4 Linear(6, 6): 36 + 6 floats each
    one_layer = (36 + 6) * 4
    order = [
        p for layer in reversed(list(model.children())) for p in reversed(list(layer.parameters()))
    ]
    flat = [p for b in _buckets(model, one_layer) for p in b]
    assert [id(p) for p in flat] == [id(p) for p in order]
    assert [len(b) for b in _buckets(model, one_layer)] == [2, 2, 2, 2]
    assert [len(b) for b in _buckets(model, 2 * one_layer)] == [4, 4]
    assert [len(b) for b in _buckets(model, 1 << 30)] == [8]


def test_failure_board_keeps_the_first_report_and_names_it_everywhere() -> None:
    from pipepar.ranks.failure import CommError, FailureBoard, Where, guarded

    store = dist.HashStore()
    first = FailureBoard(store, "p/", Where(rank=3, stage=1, replica=1))
    other = FailureBoard(store, "p/", Where(rank=0, stage=0, replica=0))
    assert other.read() is None
    assert first.post(RuntimeError("boom")) == "rank 3 (stage 1, replica 1): RuntimeError: boom"
    assert other.post(ValueError("later")) == first.read()  # the first failure wins
    closed: list[str] = []

    def broken() -> None:
        raise CommError("receiving activation 0 from rank 3 failed: Connection closed")

    with pytest.raises(ppd.PipelineError) as info:
        guarded(other, lambda: closed.append("closed"), broken)
    assert str(info.value) == (
        "pipeline failed: rank 3 (stage 1, replica 1): RuntimeError: boom "
        "(seen by rank 0 (stage 0, replica 0))"
    )
    assert closed == ["closed"]
    assert FailureBoard(store, "q/", other.here).read() is None  # another pipeline's board


def test_metadata_round_trip() -> None:
    metas = [TensorMeta((4, 3, 2), torch.float32, True), TensorMeta((4,), torch.int64, False)]
    assert decode_meta(encode_meta(metas, torch.device("cpu"))) == tuple(metas)
    with pytest.raises(ValueError, match="metadata words"):
        encode_meta([TensorMeta((1,) * 8, torch.float32, True)] * 8, torch.device("cpu"))


def test_wrap_without_a_process_group_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="launch with torchrun"):
        ppd.wrap(tiny_model(), [4, 4], chunks=2)
    with pytest.raises(ValueError, match="balance, split, split_spec and plan are None"):
        ppd.wrap(tiny_model(), None)  # type: ignore[arg-type]
