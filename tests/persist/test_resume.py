"""Nothing lost: atomic checkpoint files, and resuming gives bit-identical parameters.

Training saves a checkpoint with :mod:`pipepar.io` after every step, crashes, and a fresh job
(new model, new optimizer, other random init) resumes from the file. Its final parameters,
buffers and optimizer state must equal an uninterrupted run's bit for bit, whether it resumes
on the same pipe, another balance, another number of stages or the plain model. Pipes of any
balance compute the same bits when their stages use the same number of math threads (see
``tests/core/test_determinism.py``), so these tests pin one thread.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipepar
from pipepar.persist import files as ppio
from tests._ranks import context, settle

STEPS, CRASH_AT = 6, 4


@pytest.fixture(autouse=True)
def _one_math_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Crash(Exception):
    pass


class CrashSwitch(nn.Module):
    """Identity until ``armed``: then raises, like a machine failing mid-step."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise Crash("power cut")
        return x


def _model(init_seed: int = 0, *, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(init_seed)
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Dropout(dropout) if dropout else nn.Identity(),
        nn.Linear(32, 32),
        CrashSwitch(),
        nn.Dropout(dropout) if dropout else nn.Tanh(),
        nn.Linear(32, 4),
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step depends on the step only: the data position is the step number."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)


@dataclass
class Job:
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    step: int = 0

    @classmethod
    def new(cls, model: nn.Module) -> Job:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return cls(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))

    def train_step(self) -> None:
        x, y = _data(self.step)
        self.opt.zero_grad()
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.sched.step()
        self.step += 1

    def save(self, path: Path) -> None:
        ppio.save(
            {
                "model": self.model.state_dict(),
                "optim": self.opt.state_dict(),
                "sched": self.sched.state_dict(),
                "step": self.step,
                "rng": torch.get_rng_state(),
            },
            path,
            fsync=False,  # a throwaway file; atomicity does not depend on it
        )

    def load(self, path: Path) -> None:
        state = ppio.load(path)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every parameter, buffer and optimizer tensor, by name."""
        out = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, state in self.opt.state_dict()["state"].items():
            out |= {f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()}
        return out


def _pipe(model: nn.Sequential, balance: list[int] | None, **kwargs: object) -> nn.Module:
    if balance is None:
        return model
    kwargs.setdefault("batch_coupling", "per-micro-batch")  # batch norm per micro-batch, asked
    return pipepar.wrap(model, balance, devices=["cpu"] * len(balance), threads=1, **kwargs)  # type: ignore[arg-type]


def _uninterrupted(balance: list[int] | None, **kwargs: object) -> dict[str, torch.Tensor]:
    dropout = float(kwargs.pop("dropout", 0.0))  # type: ignore[arg-type]
    job = Job.new(_pipe(_model(dropout=dropout), balance, **kwargs))
    for _ in range(STEPS):
        job.train_step()
    return job.snapshot()


def _crash_and_resume(
    path: Path, first: list[int] | None, second: list[int] | None, **kwargs: object
) -> dict[str, torch.Tensor]:
    dropout = float(kwargs.pop("dropout", 0.0))  # type: ignore[arg-type]
    job = Job.new(_pipe(_model(dropout=dropout), first, **kwargs))
    with pytest.raises(Crash):
        while True:
            if job.step == CRASH_AT:
                job.model[5].armed = True  # type: ignore[index]
            job.train_step()
            job.save(path)  # a checkpoint after every completed step
    del job  # the crashed process is gone; a new one starts from the file
    fresh = Job.new(_pipe(_model(init_seed=123, dropout=dropout), second, **kwargs))
    fresh.load(path)
    assert fresh.step == CRASH_AT
    while fresh.step < STEPS:
        fresh.train_step()
    return fresh.snapshot()


def _assert_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, f"not bit-identical: {different}"


@pytest.mark.parametrize(
    "second",
    [[2, 2, 2, 2], [3, 3, 2], [1, 7], [4, 4], [8]],
    ids=["same", "other-balance", "uneven", "fewer-stages", "one-stage"],
)
def test_resume_on_any_balance_is_bit_identical(tmp_path: Path, second: list[int]) -> None:
    expected = _uninterrupted([2, 2, 2, 2], chunks=4)
    got = _crash_and_resume(tmp_path / "ckpt.pt", [2, 2, 2, 2], second, chunks=4)
    _assert_identical(got, expected)


@pytest.mark.parametrize(("first", "second"), [(None, [3, 5]), ([3, 5], None), ([5, 3], [2, 2, 4])])
def test_resume_between_plain_model_and_pipes(
    tmp_path: Path, first: list[int] | None, second: list[int] | None
) -> None:
    # One micro-batch: the pipe computes exactly what the plain model computes.
    expected = _uninterrupted(None)
    got = _crash_and_resume(tmp_path / "ckpt.pt", first, second, chunks=1)
    _assert_identical(got, expected)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_resume_with_dropout_in_several_stages(tmp_path: Path, checkpoint: str) -> None:
    # The global generator is part of the checkpoint; the stages' streams are seeded from it.
    kwargs: dict[str, object] = {"chunks": 4, "checkpoint": checkpoint, "dropout": 0.2}
    expected = _uninterrupted([4, 4], **kwargs)
    got = _crash_and_resume(tmp_path / "ckpt.pt", [4, 4], [4, 4], **kwargs)
    _assert_identical(got, expected)


def test_resume_with_deferred_batch_norm(tmp_path: Path) -> None:
    kwargs: dict[str, object] = {"chunks": 4, "deferred_batch_norm": True}
    expected = _uninterrupted([3, 5], **kwargs)
    got = _crash_and_resume(tmp_path / "ckpt.pt", [3, 5], [2, 6], **kwargs)
    _assert_identical(got, expected)
    assert expected["model.1.num_batches_tracked"].item() == STEPS  # once per mini-batch


# -- pipepar.io ----------------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "step": 5, "nested": [torch.arange(3), {"lr": 0.1}]}
    path = ppio.save(state, tmp_path / "new" / "dir" / "ckpt.pt")
    assert path == tmp_path / "new" / "dir" / "ckpt.pt"
    back = ppio.load(str(path))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 5
    assert torch.equal(back["nested"][0], torch.arange(3)) and back["nested"][1] == {"lr": 0.1}
    assert _leftovers(path.parent) == []
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # the checkpoint gets the permissions any new file gets (umask)
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_overwrite_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    for version in range(3):
        ppio.save({"version": version, "data": torch.full((1000,), float(version))}, path)
        back = ppio.load(path)
        assert back["version"] == version and bool((back["data"] == version).all())
    assert _leftovers(tmp_path) == []


class _FailsWhenPickled:
    def __reduce__(self) -> tuple:
        raise RuntimeError("cannot pickle this")


def test_failure_while_writing_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ppio.save({"version": 1}, path)
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        ppio.save({"version": 2, "bad": _FailsWhenPickled()}, path)
    assert ppio.load(path) == {"version": 1}
    assert _leftovers(tmp_path) == []


def test_disk_error_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    ppio.save({"version": 1}, path)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ppio.save({"version": 2, "w": torch.randn(100)}, path)
    monkeypatch.undo()
    assert ppio.load(path) == {"version": 1}
    assert _leftovers(tmp_path) == []


def _save_past_a_file_size_limit(path: Path, limit: int, crash: bool, env: dict[str, str]) -> None:
    """A save of 4 MiB under a file size limit of ``limit`` bytes: exit code 3 when it raised,
    0 when it saved (it cannot fit), or killed by SIGXFSZ mid-write when ``crash``."""
    import resource  # POSIX only, as the tests that call this

    settle(env)
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG; restoring the default
    # action makes the kernel kill the process right there instead, mid-write.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL if crash else signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        ppio.save({"version": 2, "w": torch.ones(1 << 20)}, path)
    except Exception:
        sys.exit(3)


def _write_past_a_file_size_limit(path: Path, mode: str) -> int | None:
    """The exit code of a process forked from the tests' server (torch imported) that saves
    past a file size limit (``mode``: "crash" or "error"); negative: the signal that ended it."""
    child = context().Process(
        target=_save_past_a_file_size_limit,
        args=(path, 256 * 1024, mode == "crash", dict(os.environ)),
    )
    child.start()
    child.join(120)
    if child.exitcode is None:  # hung: end it, and say so
        child.kill()
        child.join()
        raise AssertionError("the saving process hung for 120 s")
    return child.exitcode


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_process_killed_mid_write_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ppio.save({"version": 1, "w": torch.zeros(10)}, path)
    code = _write_past_a_file_size_limit(path, "crash")
    assert code == -signal.SIGXFSZ, code  # killed mid-write
    back = ppio.load(path)
    assert back["version"] == 1 and torch.equal(back["w"], torch.zeros(10))
    partial = _leftovers(tmp_path)  # the half-written new version, beside the old one
    assert len(partial) == 1 and 0 < (tmp_path / partial[0]).stat().st_size <= 256 * 1024
    path.rename(tmp_path / "older.pt")  # as if that had been the very first save
    with pytest.raises(FileNotFoundError, match=rf"interrupted save left {partial[0]}"):
        ppio.load(path)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_os_write_error_leaves_the_previous_file_and_no_debris(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ppio.save({"version": 1}, path)
    code = _write_past_a_file_size_limit(path, "error")
    assert code == 3, code  # the save raised
    assert ppio.load(path) == {"version": 1}
    assert _leftovers(tmp_path) == []


def _save_again_and_again(path: Path, saved: Any, env: dict[str, str]) -> None:
    """Save versions 1, 2, ... to ``path`` until killed; put each version once saved."""
    settle(env)
    version = 0
    while True:
        version += 1
        ppio.save({"version": version, "w": torch.full((1 << 18,), float(version))}, path)
        saved.put(version)


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ctx = context()
    saved = ctx.Queue()
    child = ctx.Process(target=_save_again_and_again, args=(path, saved, dict(os.environ)))
    child.start()
    try:
        for _ in range(3):  # let a few versions land
            try:
                saved.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"no save in 60 s; exit code {child.exitcode}") from None
        time.sleep(0.013)  # then kill it wherever it is, most likely inside a save
    finally:
        child.kill()
        child.join(30)
    back = ppio.load(path)
    assert back["version"] >= 3
    assert bool((back["w"] == back["version"]).all())  # one whole version, never a mixture


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        (None, TypeError, r"path must be a non-empty str or os\.PathLike, but got NoneType"),
        ("", TypeError, r"non-empty str"),
        (b"ckpt.pt", TypeError, r"but got bytes"),
        (42, TypeError, r"but got int 42; pass a file name"),
    ],
)
def test_bad_paths_are_refused(path: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ppio.save({}, path)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        ppio.load(path)  # type: ignore[arg-type]


def test_directory_and_missing_file_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is a directory; give a file name inside it"):
        ppio.save({}, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nope\.pt'; check the path"):
        ppio.load(tmp_path / "nope.pt")


def test_load_is_safe_by_default(tmp_path: Path) -> None:
    path = ppio.save({"fn": textwrap.dedent}, tmp_path / "code.pt")  # a function: not weights
    with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
        ppio.load(path)
    assert ppio.load(path, weights_only=False)["fn"] is textwrap.dedent
