"""pipepar.distributed under hostile inputs and faults: it never hangs, never loses work, and
always says which rank, stage and micro-batch went wrong.

Most cases run on the 4-rank gloo pool of test_distributed (a 2 x 2 grid: rank r is stage
r % 2 of replica r // 2). Killing a rank breaks its world, so SIGKILL and SIGTERM run in a
world of their own, spawned once.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    BALANCE,
    CHUNKS,
    ROWS,
    TOL,
    WIDTH,
    Pool,
    _subgroup,
    batches,
    tiny_model,
)
from torch import nn
from torch.autograd import Function

import pipepar
import pipepar.distributed as ppd
from pipepar.distributed import snapshot
from pipepar.distributed.snapshot import load_named_optimizer_state, named_optimizer_state
from tests._ranks import context, settle

GRID = {"balance": BALANCE[2], "dp": 2}  # 2 stages x 2 replicas on the 4 ranks


def _where(rank: int, schedule: str = "1f1b") -> str:
    """How reports name ``rank`` of the 2 x 2 grid (under zb-v a rank runs 2 of 4 stages)."""
    position, replica = rank % 2, rank // 2
    if schedule == "zb-v":
        return f"rank {rank} (stages {position} and {3 - position}, replica {replica})"
    return f"rank {rank} (stage {position}, replica {replica})"


# -- fault injection ----------------------------------------------------------------------------
class _Fault(nn.Module):
    """Identity that misbehaves on this rank at ``plan = (phase, micro-batch, action)``.

    ``phase`` is "forward" or "backward"; ``action`` is "raise", "raise late" (after the
    peers had time to finish their own step), a float (seconds to sleep: a stall) or a signal
    number to send to this process.
    Micro-batches are counted by forward calls since ``calls`` was reset (use
    checkpoint="never" so no recomputation counts twice).
    """

    plan: tuple[str, int, Any] | None = None
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = _Fault.calls
        _Fault.calls += 1
        _Fault.strike("forward", i)
        return _StrikeInBackward.apply(x, i)

    @staticmethod
    def strike(phase: str, i: int) -> None:
        if _Fault.plan is None or _Fault.plan[:2] != (phase, i):
            return
        action = _Fault.plan[2]
        if isinstance(action, float):
            time.sleep(action)
            return
        if action in ("raise", "raise late"):
            time.sleep(0.5 if action == "raise late" else 0)
            raise RuntimeError("boom")
        os.kill(os.getpid(), action)
        time.sleep(5)  # a handled signal raises here; an unhandled one ends the process


class _StrikeInBackward(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, i: int) -> torch.Tensor:
        ctx.i = i
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _Fault.strike("backward", ctx.i)
        return grad, None


def fault_model() -> nn.Sequential:
    """Like tiny_model's first half twice, with a _Fault on each stage of balance [4, 4] (and on
    one stage of each rank with zb-v's [2, 2, 2, 2]: stages 1 and 3)."""
    torch.manual_seed(1)
    return nn.Sequential(*_fault_block(), *_fault_block())


def _fault_block() -> list[nn.Module]:
    return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Fault(), nn.Linear(WIDTH, WIDTH)]


def _loss_with_fault(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    i = _Fault.calls - 1  # the last stage computes the loss right after its forward of i
    if _Fault.plan is not None and _Fault.plan[:2] == ("loss_fn", i):
        raise RuntimeError("boom")
    return nn.functional.mse_loss(out, y)


def _failing_step(pipe: ppd.DistributedPipe, plan: tuple[str, int, Any] | None) -> dict:
    """One step with ``plan`` armed on this rank; what came out and how long it took."""
    x, y = batches(2, 1)[0]
    _Fault.calls, _Fault.plan = 0, plan
    start = time.monotonic()
    out: dict[str, Any] = {"raised": "nothing", "message": "", "cause": ""}
    try:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], _loss_with_fault)
    except (ppd.PipelineError, KeyboardInterrupt, SystemExit) as e:
        out = {"raised": type(e).__name__, "message": str(e), "cause": repr(e.__cause__)}
    finally:
        _Fault.plan = None
    out["elapsed"] = time.monotonic() - start
    return out


# -- cases (run on every rank of the pool) ------------------------------------------------------
def _disagreeing(rank: int) -> dict[str, dict[str, Any]]:
    """Per label, the wrap arguments of this rank: one rank differs from the others."""
    with torch.device("meta"):
        wider = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(7)], nn.Linear(WIDTH, 7))
    base = {"model": tiny_model(), **GRID, "chunks": CHUNKS}
    odd = {
        "chunks": (3, {"chunks": 2}),
        "balance": (1, {"balance": [5, 3]}),
        "schedule": (2, {"schedule": "1f1b"}),
        "grid": (3, {"balance": [2, 2, 2, 2], "dp": 1}),
        "checkpoint": (0, {"checkpoint": "never"}),
        "state_dict": (1, {"state_dict": tiny_model().state_dict()}),
        "model": (2, {"model": wider}),
        "refused": (2, {"dp": 3}),
        "missing": (3, {}),
    }
    return {label: {**base, **(kw if rank == who else {})} for label, (who, kw) in odd.items()}


def case_disagreements(rank: int, timeout: float) -> dict:
    out = {}
    for label, kwargs in _disagreeing(rank).items():
        if label == "missing" and rank == 3:
            time.sleep(2 * timeout)  # arrives after the others gave up
        start = time.monotonic()
        try:
            ppd.wrap(**kwargs, timeout=timeout).close()
            out[label] = ("nothing", "", 0.0)
        except (ValueError, TypeError, ppd.PipelineError) as e:
            out[label] = (type(e).__name__, str(e), time.monotonic() - start)
    # counters stayed in step: agreeing ranks still build a working pipeline
    pipe = ppd.wrap(tiny_model(), **GRID, chunks=CHUNKS)
    x, y = batches(2, 1)[0]
    out["after"] = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
    pipe.close()
    return out


def case_shapes(rank: int) -> dict:
    """Three bad or changing shapes; each failing pipe has timeout=20, the case takes ~1 s."""
    out: dict[str, Any] = {}
    x, y = batches(2, 1)[0]
    start = time.monotonic()
    # 1. replicas with mini-batches of different shapes
    pipe = ppd.wrap(tiny_model(), **GRID, chunks=2, timeout=20)
    rows = ROWS if pipe.dp_rank == 0 else ROWS - 2
    try:
        pipe.step(x[pipe.dp_rank, :rows], y[pipe.dp_rank, :rows], nn.functional.mse_loss)
        out["replicas"] = "no error"
    except ppd.PipelineError as e:
        out["replicas"] = str(e)
    # 2. a batch size change on every replica is a new signature: carried, and exact
    pipe = ppd.wrap(tiny_model(), **GRID, chunks=2)
    plain = tiny_model()
    out["resized"] = []
    for rows in (ROWS, ROWS - 2, ROWS):
        loss = pipe.step(x[pipe.dp_rank, :rows], y[pipe.dp_rank, :rows], nn.functional.mse_loss)
        pieces = [(x[d, :rows], y[d, :rows]) for d in range(2)]
        ref = sum(nn.functional.mse_loss(plain(a), b).item() for a, b in pieces) / 2
        out["resized"].append(abs(loss - ref))
    pipe.close()
    # 3. a stage whose output changes shape or dtype for the same input shape
    for label, change in (("narrower", lambda t: t[:, :-1]), ("dtype", lambda t: t.double())):
        out[label] = _changing_stage(rank, change, x, y)
    out["elapsed"] = time.monotonic() - start
    return out


class _Changer(nn.Module):
    change: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t if _Changer.change is None else _Changer.change(t)


def _changing_stage(rank: int, change: Callable, x: torch.Tensor, y: torch.Tensor) -> str:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _Changer(), nn.Linear(WIDTH, WIDTH))
    pipe = ppd.wrap(model, [2, 1], chunks=2, dp=2, checkpoint="never", timeout=20)
    loss_fn = nn.functional.mse_loss
    pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], loss_fn)  # shapes are cached from here on
    _Changer.change = change if rank == 0 else None
    try:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], loss_fn)
        return "no error"
    except ppd.PipelineError as e:
        return str(e)
    finally:
        _Changer.change = None


def case_faults(rank: int, plans: list[tuple[int, str, int, str, str]], timeout: float) -> dict:
    """For each (rank, phase, micro-batch, schedule, action): a good step, then a failing one."""
    outcomes = []
    for target, phase, i, schedule, action in plans:
        balance = [2, 2, 2, 2] if schedule == "zb-v" else [4, 4]
        pipe = ppd.wrap(
            fault_model(), balance, chunks=3, dp=2, schedule=schedule, checkpoint="never",
            timeout=timeout,
        )  # fmt: skip
        _failing_step(pipe, None)
        outcome = _failing_step(pipe, (phase, i, action) if rank == target else None)
        outcome["closed"] = pipe.mesh.closed
        outcome["again"] = _failing_step(pipe, None)
        outcomes.append(outcome)
    dist.barrier()  # the world outlives every failed pipeline
    return {"outcomes": outcomes, "recovered": _train_and_compare()}


def _train_and_compare() -> float:
    """A fresh pipeline on the same ranks trains exactly like the plain model."""
    pipe = ppd.wrap(tiny_model(), **GRID, chunks=CHUNKS, schedule="1f1b")
    plain = tiny_model()
    x, y = batches(2, 1)[0]
    pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
    nn.functional.mse_loss(plain(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH)).backward()
    ref = dict(plain.named_parameters())
    worst = max((p.grad - ref[k].grad).abs().max().item() for k, p in pipe.named_parameters())
    pipe.close()
    return worst


def case_interrupt(rank: int, target: int, how: str) -> dict:
    """``target`` is interrupted in the forward of micro-batch 1 by SIGINT or a SIGTERM handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    if how == "SIGTERM":
        previous_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pipe = ppd.wrap(fault_model(), [4, 4], chunks=3, dp=2, checkpoint="never", timeout=20)
    _failing_step(pipe, None)
    number = signal.SIGINT if how == "SIGINT" else signal.SIGTERM
    try:
        return _failing_step(pipe, ("forward", 1, number) if rank == target else None)
    finally:
        signal.signal(signal.SIGINT, previous)
        if how == "SIGTERM":
            signal.signal(signal.SIGTERM, previous_term)
        dist.barrier()


def _train(pipe: ppd.DistributedPipe, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()


def _fresh(state_dict: dict | None = None) -> tuple[ppd.DistributedPipe, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = tiny_model()
    pipe = ppd.wrap(model, **GRID, chunks=CHUNKS, schedule="1f1b", state_dict=state_dict)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01)


def case_resume(rank: int, folder: str) -> dict:
    """4 steps straight vs 2 steps, save, new pipeline (other init), load, 2 steps."""
    data, path = batches(2, 4), os.path.join(folder, "ckpt.pt")
    pipe, opt = _fresh(tiny_model().state_dict())
    _train(pipe, opt, data)
    straight = pipe.full_state_dict()
    pipe.close()
    pipe, opt = _fresh(tiny_model().state_dict())
    _train(pipe, opt, data[:2])
    ppd.save_checkpoint(path, pipe, opt, extra={"step": 2})
    at_save = pipe.full_state_dict()
    pipe.close()
    torch.manual_seed(100 + rank)
    pipe, opt = _fresh()  # reset_parameters: other weights until the checkpoint is loaded
    extra = ppd.load_checkpoint(path, pipe, opt)
    _train(pipe, opt, data[2:])
    resumed = pipe.full_state_dict()
    crash = _crash_while_saving(rank, pipe, opt, path)
    pipe.close()
    return {
        "identical": all(torch.equal(straight[k], v) for k, v in resumed.items()),
        "keys": sorted(resumed) == sorted(straight),
        "extra": extra,
        "straight": straight,
        "at_save": at_save,
        "crash": crash,
    }


def _crash_while_saving(rank: int, pipe: ppd.DistributedPipe, opt: Any, path: str) -> dict:
    """The writer dies half-way through torch.save: the previous file must survive intact."""
    real_save = torch.save

    def half_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(obj, dict) and obj.get("format") == snapshot.FORMAT):
            return real_save(obj, f, *args, **kwargs)  # torch.distributed pickles with it
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError(28, "No space left on device")

    torch.save = half_then_die  # type: ignore[assignment]
    try:
        ppd.save_checkpoint(path, pipe, opt, extra={"step": 4})
        raised = "nothing"
    except (OSError, RuntimeError) as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    x, y = batches(2, 1)[0]  # the pipe is still usable after a failed save
    loss = pipe.step(x[pipe.dp_rank], y[pipe.dp_rank], nn.functional.mse_loss)
    return {"raised": raised, "loss": loss, "files": sorted(os.listdir(os.path.dirname(path)))}


# -- tests: bad inputs --------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_that_disagree_at_wrap_all_fail_with_both_values(pool: Pool) -> None:
    timeout = 1.0
    results = pool.run(case_disagreements, timeout)
    expected = {
        "chunks": "chunks is 4 on rank(s) [0, 1, 2] but 2 on rank(s) [3]",
        "balance": "balance is [3, 5] on rank(s) [0, 2, 3] but [5, 3] on rank(s) [1]",
        "schedule": "schedule is gpipe (actions",
        "grid": "dp is 2 on rank(s) [0, 1, 2] but 1 on rank(s) [3]",
        "checkpoint": "checkpoint is 'except_last' on rank(s) [1, 2, 3] but 'never' on rank(s) [0]",
        "state_dict": "state_dict is None on rank(s) [0, 2, 3] but given on rank(s) [1]",
        "model": "model is 8 layers of 168 values (structure ",  # 4 x Linear(6, 6)
        "refused": "balance has 2 stages and dp=3, so the grid needs 6 ranks, but the process "
        "group has 4",
        "missing": "rank(s) [3] did not call ppd.wrap within 1 s, while ranks [0, 1, 2] did",
    }
    for rank, r in enumerate(results):
        for label, text in expected.items():
            kind, message, elapsed = r[label]
            assert text in message, (rank, label, message)
            assert kind == ("PipelineError" if label == "missing" else "ValueError"), (rank, r)
            assert elapsed < (timeout + 2 if label == "missing" else 1.0), (rank, label)
            if label not in ("missing", "refused"):
                assert "pass the same model and arguments to ppd.wrap on every rank" in message
        assert "but 1f1b (actions" in r["schedule"][1]
        assert "balance is [3, 5] on rank(s) [0, 1, 2] but [2, 2, 2, 2]" in r["grid"][1]
        assert "but 8 layers of 343 values (structure " in r["model"][1]  # 7 x 42 + 42 + 7
        if rank != 2:  # rank 2 raised its own error; the others name it
            assert r["refused"][1].startswith("rank 2 refused the arguments of ppd.wrap")
        assert r["after"] > 0


@pytest.mark.slow
def test_inputs_of_different_shapes_are_refused_clearly_or_carried(pool: Pool) -> None:
    results = pool.run(case_shapes)
    for rank, r in enumerate(results):
        assert "the replicas got mini-batches of different shapes" in r["replicas"], (rank, r)
        assert (
            "x is (8, 6) float32 on rank(s) [0] but (6, 6) float32 on rank(s) [2]"
            in (r["replicas"])
        )
        assert max(r["resized"]) < TOL, (rank, r["resized"])
        # the sender refuses before gloo would abort the receiver on a size mismatch
        assert (
            "rank 0 (stage 0, replica 0) failed in the forward of micro-batch 0: ValueError: "
            "stage 0 output of micro-batch 0 is (4, 5) float32 but was (4, 6) float32"
        ) in r["narrower"], (rank, r["narrower"])
        assert "is (4, 6) float64 but was (4, 6) float32" in r["dtype"], (rank, r["dtype"])
        assert r["elapsed"] < 10.0  # two failures, each detected long before its 20 s timeout


# -- tests: faults ------------------------------------------------------------------------------
FAULTS = [  # (rank, phase, micro-batch, schedule, action) on the 2 x 2 grid, chunks=3
    (0, "forward", 0, "gpipe", "raise"),
    (3, "forward", 2, "1f1b", "raise"),
    (1, "backward", 0, "gpipe", "raise"),
    (2, "backward", 1, "1f1b", "raise"),
    # stage 0's last backward, after every other rank has sent all it had to send
    (0, "backward", 2, "1f1b", "raise late"),
    (3, "loss_fn", 1, "gpipe", "raise"),
    # ranks of 2 stages: the report names the rank's stages and the one that failed
    (2, "backward", 1, "zb-v", "raise"),
    (1, "forward", 2, "zb-v", "raise"),
]
FAULT_STAGE = {("zb-v", 0): 3, ("zb-v", 1): 1}  # the stage holding the _Fault of a position


@pytest.mark.slow
def test_an_exception_anywhere_ends_every_rank_with_its_position(pool: Pool) -> None:
    timeout = 20.0
    results = pool.run(case_faults, FAULTS, timeout)
    for rank, r in enumerate(results):
        for (target, phase, i, schedule, _), out in zip(FAULTS, r["outcomes"], strict=True):
            stage = FAULT_STAGE.get((schedule, target % 2))
            of_stage = "" if stage is None else f" of stage {stage}"
            where = _where(target, schedule)
            report = f"{where} failed in the {phase} of micro-batch {i}{of_stage}: "
            assert out["raised"] == "PipelineError", (rank, target, phase, out)
            assert report + "RuntimeError: boom" in out["message"], (rank, out)
            assert out["elapsed"] < 5.0 < timeout, (rank, out)  # not by a timeout
            assert out["closed"]
            assert "the pipeline is closed" in out["again"]["message"]
            assert out["again"]["elapsed"] < 0.5
            if rank == target:  # the caller gets the original exception as the cause
                assert out["cause"] == "RuntimeError('boom')", out
        assert r["recovered"] < TOL  # a new pipeline on the same processes trains exactly


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_rank_stops_and_every_other_rank_is_told(pool: Pool, how: str) -> None:
    target = 2
    own = {"SIGINT": "KeyboardInterrupt", "SIGTERM": "SystemExit"}[how]
    results = pool.run(case_interrupt, target, how)
    for rank, r in enumerate(results):
        assert r["elapsed"] < 5.0, (rank, r)
        if rank == target:
            assert r["raised"] == own, r
            continue
        assert r["raised"] == "PipelineError", (rank, r)
        report = f"{_where(target)} failed in the forward of micro-batch 1: {own}"
        assert report in r["message"], (rank, r)


# -- tests: nothing lost ------------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_resume_is_bit_identical_and_loads_anywhere(pool: Pool, tmp_path: Path) -> None:
    results = pool.run(case_resume, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["keys"] and r["identical"], f"rank {rank}: resumed run differs"
        assert r["extra"] == {"step": 2}
        raised = r["crash"]["raised"]
        if rank == 0:  # the writer gets its own error, the others a report of it
            assert raised == "OSError: [Errno 28] No space left on device", raised
        else:
            assert raised.startswith("RuntimeError: checkpoint ") and "rank 0 (stage 0" in raised
            assert "could not write it: OSError: [Errno 28]" in raised
        assert r["crash"]["files"] == ["ckpt.pt"]  # no temporary file left behind
        assert r["crash"]["loss"] > 0
    path = tmp_path / "ckpt.pt"
    saved = torch.load(path, weights_only=True)  # the step-2 file survived the failed write
    at_save, straight = results[0]["at_save"], results[0]["straight"]
    assert saved["model"].keys() == at_save.keys()
    assert all(torch.equal(saved["model"][k], v) for k, v in at_save.items())
    assert saved["balance"] == BALANCE[2] and saved["dp"] == 2
    # the same file resumes a single-process pipeline (other balance) and the plain model
    for module in (
        pipepar.wrap(tiny_model(seed=7), [4, 4], devices=["cpu", "cpu"], chunks=CHUNKS),
        tiny_model(seed=7),
    ):
        opt = torch.optim.Adam(module.parameters(), lr=0.01)
        assert ppd.load_checkpoint(path, module, opt) == {"step": 2}
        assert all(torch.equal(v, at_save[k]) for k, v in module.state_dict().items())
        for x, y in batches(2, 4)[2:]:
            nn.functional.mse_loss(module(x.reshape(-1, WIDTH)), y.reshape(-1, WIDTH)).backward()
            opt.step()
            opt.zero_grad()
        worst = max((v - straight[k]).abs().max().item() for k, v in module.state_dict().items())
        assert worst < TOL, (type(module).__name__, worst)
        if isinstance(module, pipepar.Pipe):
            module.close()


# -- tests: stalls (two pipelines of two ranks on the pool: ranks 0-1 and 2-3) ------------------
STALL_TIMEOUT = 2.0
NAP = STALL_TIMEOUT + 1.5  # how long the stalling rank is away


def case_stalls(rank: int) -> dict:
    """nn.Sequential, 1f1b, chunks=2. Pipeline 0-1: rank 0 sleeps in its forward of micro-batch
    1. Pipeline 2-3: rank 3 skips a step (it sleeps outside pipe.step, then steps late)."""
    group = _subgroup(2)
    unlimited = ppd.wrap(tiny_model(), BALANCE[2], chunks=2, group=group, timeout=None)
    x, y = batches(1, 1)[0]
    out: dict[str, Any] = {"unlimited": unlimited.step(x[0], y[0], nn.functional.mse_loss)}
    out["unlimited_timeout"] = unlimited.mesh.progress.timeout
    unlimited.close()
    pipe = ppd.wrap(
        fault_model(), [4, 4], chunks=2, schedule="1f1b", checkpoint="never", group=group,
        timeout=STALL_TIMEOUT,
    )  # fmt: skip
    _failing_step(pipe, None)
    if rank == 3:
        time.sleep(NAP)
    out |= _failing_step(pipe, ("forward", 1, NAP) if rank == 0 else None)
    out["again"] = _failing_step(pipe, None)["message"]
    return out


class _Nap(nn.Module):
    """Identity that sleeps once, on the rank computing it for real (not in shadow on meta),
    in its ``plan = (phase, seconds)``: the first forward or backward after it is set."""

    plan: tuple[str, float] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Nap.plan is not None and _Nap.plan[0] == "forward" and not x.is_meta:
            _Nap.plan, seconds = None, _Nap.plan[1]
            time.sleep(seconds)
        return _NapInBackward.apply(x)


class _NapInBackward(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _Nap.plan is not None and _Nap.plan[0] == "backward" and not grad.is_meta:
            _Nap.plan, seconds = None, _Nap.plan[1]
            time.sleep(seconds)
        return grad


class _NapNet(nn.Module):
    """Not an nn.Sequential (the any-model route): 4 x (Linear + Tanh), a _Nap in each half."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.naps = nn.ModuleList([_Nap(), _Nap()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if k in (0, 3):
                x = self.naps[k // 3](x)
        return x


def case_model_stalls(rank: int) -> dict:
    """The any-model route, 1f1b, chunks=2. Pipeline 0-1: rank 0 sleeps in its forward of
    micro-batch 0. Pipeline 2-3: rank 3 sleeps in its backward of micro-batch 0."""
    pipe = ppd.wrap(
        _NapNet(), split=["blocks.2"], chunks=2, schedule="1f1b", group=_subgroup(2),
        timeout=STALL_TIMEOUT,
    )  # fmt: skip
    x, y = batches(1, 1)[0]
    loss = nn.functional.mse_loss
    pipe.step(x[0], target=y[0], loss_fn=loss)
    _Nap.plan = {0: ("forward", NAP), 3: ("backward", NAP)}.get(rank)
    out: dict[str, Any] = {"raised": "nothing", "message": ""}
    start = time.monotonic()
    try:
        pipe.step(x[0], target=y[0], loss_fn=loss)
    except ppd.PipelineError as e:
        out = {"raised": type(e).__name__, "message": str(e)}
    finally:
        _Nap.plan = None
    out["elapsed"] = time.monotonic() - start
    try:
        pipe.step(x[0], target=y[0], loss_fn=loss)
        out["again"] = "no error"
    except ppd.PipelineError as e:
        out["again"] = str(e)
    return out


def _check_stall(results: list[dict], reports: dict[int, str], away: dict[int, str]) -> None:
    """Every rank raised its pipeline's report (``reports[waiting rank]``, which also says
    where the rank that was ``away`` stood); the waiting rank after about the timeout, the
    one away when it came back, without waiting out another timeout."""
    for waiting, report in reports.items():
        pair = (waiting // 2 * 2, waiting // 2 * 2 + 1)
        for rank in pair:
            r = results[rank]
            assert r["raised"] == "PipelineError", (rank, r)
            assert report in r["message"], (rank, r["message"])
            assert away[waiting] in r["message"], (rank, r["message"])
            assert "the pipeline is closed" in r["again"], (rank, r)
        elapsed = results[waiting]["elapsed"]
        assert STALL_TIMEOUT * 0.9 < elapsed < STALL_TIMEOUT + 3, (waiting, elapsed)
        sleeper = pair[0] + pair[1] - waiting
        assert results[sleeper]["elapsed"] < NAP + 3, (sleeper, results[sleeper])


@pytest.mark.slow
def test_a_stalled_step_ends_every_rank_saying_where_each_stands(pool: Pool) -> None:
    results = pool.run(case_stalls)
    for r in results:
        assert r["unlimited"] > 0 and r["unlimited_timeout"] is None  # timeout=None runs
    wait = f"no answer within timeout={STALL_TIMEOUT:g} s"
    reports = {
        1: "rank 1 (stage 1, replica 0) failed in the forward of micro-batch 1: StallError: "
        f"receiving activation 1 for stage 1 from rank 0 (stage 0): {wait}",
        2: "rank 2 (stage 0, replica 0) failed in the backward of micro-batch 0: StallError: "
        f"receiving gradient 0 for stage 0 from rank 3 (stage 1): {wait}",
    }
    away = {
        1: "[rank 0 (stage 0, replica 0) is in step 2 at the forward of micro-batch 1, not "
        "blocked in a transfer, last finished the forward of micro-batch 0]",
        2: "[rank 3 (stage 1, replica 0) finished step 1 and is outside pipe.step]",
    }
    _check_stall(results, reports, away)
    assert "a rank that skipped one" in results[3]["message"]  # the way out


@pytest.mark.slow
def test_a_stall_in_any_model_ends_every_rank_saying_where_each_stands(pool: Pool) -> None:
    wait = f"no answer within timeout={STALL_TIMEOUT:g} s"
    reports = {
        1: "rank 1 (stage 1, replica 0) failed in the forward of micro-batch 0: StallError: "
        f"receiving an activation (4, 6) float32 from rank 0 (stage 0): {wait}",
        2: "rank 2 (stage 0, replica 0) failed in the backward of micro-batch 0: StallError: "
        f"receiving a gradient (4, 6) float32 from rank 3 (stage 1): {wait}",
    }
    away = {
        1: "[rank 0 (stage 0, replica 0) is in step 2 at the forward of micro-batch 0, not "
        "blocked in a transfer, last finished the start of the mini-batch]",
        2: "[rank 3 (stage 1, replica 0) is in step 2 at the backward of micro-batch 0, not "
        "blocked in a transfer, last finished the forward of micro-batch 0]",
    }
    _check_stall(pool.run(case_model_stalls), reports, away)


@pytest.mark.slow
def test_a_rank_that_skips_a_step_under_torchrun_is_named(tmp_path: Path) -> None:
    """As users launch: torchrun, ppd.wrap starting the process group, the c10d store of the
    torchrun rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
        str(root / "tests/distributed/_stall_main.py"), str(tmp_path), str(STALL_TIMEOUT), str(NAP),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    report = (
        "rank 0 (stage 0, replica 0) failed in the backward of micro-batch 0: StallError: "
        "receiving gradient 0 for stage 0 from rank 1 (stage 1): no answer within "
        f"timeout={STALL_TIMEOUT:g} s [rank 1 (stage 1, replica 0) finished step 1 and is "
        "outside pipe.step]"
    )
    for rank, r in enumerate(results):
        assert r["raised"] == "PipelineError" and report in r["message"], (rank, r)
    assert STALL_TIMEOUT * 0.9 < results[0]["elapsed"] < STALL_TIMEOUT + 3, results[0]
    assert results[1]["elapsed"] < 3, results[1]  # told at once when it came back


# -- tests: killed ranks (a world of their own) -------------------------------------------------
KILL_WORLD = 6


def _doomed(rank: int, port: int, out: Any, done: Any, timeout: float, env: dict) -> None:
    """Ranks 0-3: a 2 x 2 grid whose rank 3 is SIGKILLed in the backward of micro-batch 1.
    Ranks 4-5: a 2-stage pipeline whose rank 5 gets SIGTERM in the forward of micro-batch 2."""
    settle(env)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=KILL_WORLD
    )
    grid, pair = dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5])
    if rank < 4:
        pipe = ppd.wrap(
            fault_model(), [4, 4], chunks=3, dp=2, checkpoint="never", group=grid,
            timeout=timeout,
        )  # fmt: skip
        plan = ("backward", 1, signal.SIGKILL) if rank == 3 else None
    else:
        pipe = ppd.wrap(
            fault_model(), [4, 4], chunks=3, schedule="1f1b", checkpoint="never", group=pair,
            timeout=timeout,
        )  # fmt: skip
        plan = ("forward", 2, signal.SIGTERM) if rank == 5 else None
    _failing_step(pipe, None)
    result = _failing_step(pipe, plan)
    out.put((rank, result))
    done.wait(60)  # rank 0 hosts the store: stay until every survivor has read it


@pytest.mark.slow
def test_a_killed_rank_ends_every_other_rank_within_the_timeout() -> None:
    timeout = 10.0
    ctx = context()
    out, done = ctx.Queue(), ctx.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_doomed, args=(r, port, out, done, timeout, env), daemon=True)
        for r in range(KILL_WORLD)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in range(KILL_WORLD - 2):
            rank, result = out.get(timeout=90)
            results[rank] = result
    except queue.Empty:
        pytest.fail(f"survivors {sorted(set(range(6)) - {3, 5} - set(results))} never returned")
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
    assert [p.is_alive() for p in procs] == [False] * KILL_WORLD  # no process left running
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0, 0, -signal.SIGKILL, 0, -signal.SIGTERM], codes
    for rank, r in results.items():
        dead = 3 if rank < 4 else 5
        assert r["raised"] == "PipelineError", (rank, r)
        assert r["elapsed"] < timeout, (rank, r)
        assert f"from rank {dead}" in r["message"] or f"ranks [1, {dead}]" in r["message"], r
        assert re.search(r"Connection (closed|reset) by peer", r["message"]), (rank, r)
        assert "a peer process died" in r["message"], (rank, r)


# -- tests: no process group --------------------------------------------------------------------
def test_optimizer_state_moves_by_name_between_splits() -> None:
    model = tiny_model()
    opt = torch.optim.Adam(
        [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[2:].parameters()}],
        lr=0.01,
    )
    nn.functional.mse_loss(model(torch.randn(4, WIDTH)), torch.randn(4, WIDTH)).backward()
    opt.step()
    saved = named_optimizer_state(model, opt)
    assert saved["param_groups"][0]["params"] == ["0.weight", "0.bias"]
    # a "stage" holding layers 4..7 only, its optimizer in one group: it takes group 1's lr
    stage = nn.Sequential()
    for name in ("4", "5", "6", "7"):
        stage.add_module(name, tiny_model(seed=3)[int(name)])
    stage_opt = torch.optim.Adam(stage.parameters(), lr=123.0)
    load_named_optimizer_state(stage, stage_opt, saved)
    assert stage_opt.param_groups[0]["lr"] == 0.01
    for name, p in stage.named_parameters():
        mine, ref = stage_opt.state[p], opt.state[dict(model.named_parameters())[name]]
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
        assert mine["exp_avg"] is not saved["state"][name]["exp_avg"]  # a copy, not an alias


def test_optimizer_state_errors_name_the_parameters() -> None:
    model, other = tiny_model(), tiny_model()
    with pytest.raises(ValueError, match=r"holds 8 parameter\(s\) \(shapes \[\(6, 6\), \(6,\)"):
        named_optimizer_state(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        named_optimizer_state(model, "adam")  # type: ignore[arg-type]
    saved = named_optimizer_state(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"no entry for parameter\(s\) \['2.weight'"):
        load_named_optimizer_state(model, torch.optim.SGD(model.parameters(), lr=0.1), saved)
    split = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.2}, {"params": model[2:].parameters()}],
        lr=0.1,
    )
    whole = named_optimizer_state(model, split)
    with pytest.raises(ValueError, match="group 0 holds parameters that were in 2 saved groups"):
        load_named_optimizer_state(model, torch.optim.SGD(model.parameters(), lr=0.1), whole)


def test_load_checkpoint_refuses_other_files(tmp_path: Path) -> None:
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="is not a pipepar checkpoint"):
        ppd.load_checkpoint(tmp_path / "bare.pt", model)
    torch.save({"format": snapshot.FORMAT, "model": model.state_dict()}, tmp_path / "w.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        ppd.load_checkpoint(tmp_path / "w.pt", model, opt)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing\.pt"):
        ppd.load_checkpoint(tmp_path / "missing.pt", model)
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike"):
        ppd.load_checkpoint(3, model)  # type: ignore[arg-type]
