"""Random numbers drawn any way inside a layer are replayed by recompute, in every schedule."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipepar
from pipepar.core import randomness
from pipepar.core.randomness import DrawLog, Recorded, Streams

WIDTH = 16


class _FunctionalDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.3, training=self.training)


class _RandLikeMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) > 0.4)


class _Bernoulli(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.bernoulli(torch.full_like(x, 0.7))


class _AttentionDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 2, 4, WIDTH // 8)  # batch, heads, tokens, head size
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3 if self.training else 0.0)
        return out.reshape(x.shape)


DRAWS = [_FunctionalDropout, _RandLikeMask, _Bernoulli, _AttentionDropout]


def _model(draw: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), draw(), nn.Tanh(), nn.Linear(WIDTH, WIDTH), draw(),
        nn.Linear(WIDTH, WIDTH),
    )  # fmt: skip


def _run(model: nn.Sequential, checkpoint: str, balance: list[int], schedule: str) -> list:
    workers = len(balance) // 2 if schedule == "zb-v" else len(balance)
    pipe = pipepar.wrap(
        model, balance, devices=["cpu"] * workers, chunks=4, checkpoint=checkpoint,
        schedule=schedule,
    )  # fmt: skip
    torch.manual_seed(7)
    x = torch.randn(8, WIDTH, requires_grad=True)
    out = pipe(x)
    out.pow(2).sum().backward()
    torch.manual_seed(7)
    loss = pipe.step(x.detach(), torch.zeros(8, WIDTH), F.mse_loss)
    return [out.detach(), x.grad, loss, *[p.grad.clone() for p in model.parameters()]]


@pytest.mark.parametrize("draw", DRAWS, ids=lambda d: d.__name__.strip("_"))
@pytest.mark.parametrize(
    ("balance", "schedule"), [([3, 3], "1f1b"), ([6], "gpipe"), ([2, 1, 1, 2], "zb-v")]
)
def test_recompute_replays_every_kind_of_draw(
    draw: type[nn.Module], balance: list[int], schedule: str
) -> None:
    expected = _run(_model(draw), "never", balance, schedule)
    for checkpoint in ("always", "except_last"):
        got = _run(_model(draw), checkpoint, balance, schedule)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_issue_repro_input_gradient_is_zero_where_dropout_dropped() -> None:
    model = nn.Sequential(_FunctionalDropout(), _FunctionalDropout())
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"], chunks=8, checkpoint="always")
    x = torch.randn(64, WIDTH, requires_grad=True)
    out = pipe(x)
    out.sum().backward()
    assert x.grad is not None
    assert bool(((out == 0) == (x.grad == 0)).all())


@pytest.mark.parametrize("draw", DRAWS, ids=lambda d: d.__name__.strip("_"))
def test_the_same_seed_gives_the_same_run(draw: type[nn.Module]) -> None:
    first = _run(_model(draw), "except_last", [2, 2, 2], "zb-h1")
    again = _run(_model(draw), "except_last", [2, 2, 2], "zb-h1")
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_one_worker_draws_like_the_plain_model() -> None:
    model = _model(_RandLikeMask)
    plain = copy.deepcopy(model)
    pipe = pipepar.wrap(model, [6], devices=["cpu"], chunks=2, checkpoint="always")
    x = torch.randn(4, WIDTH)
    torch.manual_seed(3)
    got = pipe(x)
    torch.manual_seed(3)
    expected = torch.cat([plain(part) for part in x.chunk(2)])
    assert torch.equal(got, expected)


def test_eval_mode_and_p_zero_do_not_touch_the_generator() -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.0), nn.Linear(WIDTH, WIDTH))
    pipe = pipepar.wrap(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, WIDTH)
    before = torch.get_rng_state()
    pipe(x).sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


def test_streams_hold_the_generator_only_for_one_operator() -> None:
    streams = Streams(seed=5)
    entered, release = threading.Event(), threading.Event()

    class _Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(5)
            return x

    def other() -> None:
        with streams.drawing(0, 0):
            _Slow.apply(torch.rand(2))  # a slow non-random op after a random one

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(5)
    with streams.drawing(1, 0):  # does not wait for the other stream's slow op
        torch.rand(2)
    release.set()
    thread.join()


def test_recorded_replay_refuses_a_forward_that_draws_differently() -> None:
    r = Recorded()
    with r.drawing(0, 0):
        torch.rand(2)
    match = "drew random numbers the first forward did not"
    with pytest.raises(RuntimeError, match=match), r.drawing(0, 0):
        torch.rand(2)
        torch.rand(2)


class _Sometimes(nn.Module):
    """Draws only while ``on`` is set: randomness the train/eval flags do not announce."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) > 0.5) if self.on else x


def _steps(model: nn.Sequential, checkpoint: str, switch_at: int | None = None) -> list:
    """Four seeded steps of a two-worker pipe; ``model[1].on`` is set before step ``switch_at``."""
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    x, results = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1)), []
    for k in range(4):
        if k == switch_at:
            model[1].on = True
        torch.manual_seed(100 + k)
        loss = pipe.step(x, torch.zeros(8, WIDTH), F.mse_loss)
        results += [loss, *[p.grad.clone() for p in model.parameters()]]
        model.zero_grad(set_to_none=True)
    return results


def _sometimes_model(on: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _Sometimes(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    model[1].on = on
    return model


def test_steps_repeat_and_replay_while_quiet_stages_skip_the_streams() -> None:
    # Stage 0 draws in every step, stage 1 never: after the first step stage 1 runs without
    # the random-stream mode; every step still repeats bit for bit, and recompute replays.
    with warnings.catch_warnings():
        # the quiet stage is checked once per mini-batch, beside the other's seeded draws
        warnings.simplefilter("error", RuntimeWarning)
        first = _steps(_sometimes_model(on=True), "never")
    again = _steps(_sometimes_model(on=True), "never")
    recomputed = _steps(_sometimes_model(on=True), "always")
    for a, b, c in zip(first, again, recomputed):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_a_quiet_stage_that_starts_drawing_warns_once_and_is_watched_again() -> None:
    with pytest.warns(RuntimeWarning, match="stage (0|0 or 1) drew random numbers") as caught:
        first = _steps(_sometimes_model(), "never", switch_at=2)
    assert len([w for w in caught if "drew random numbers" in str(w.message)]) == 1
    with pytest.warns(RuntimeWarning):
        again = _steps(_sometimes_model(), "never", switch_at=2)
    per_step = len(first) // 4
    # the step that revealed the draw took the shared generator; the next one uses streams
    for a, b in zip(first[3 * per_step :], again[3 * per_step :]):
        assert torch.equal(a, b)


def test_streams_skip_the_mode_only_for_a_known_quiet_stage_and_a_block_not_replayed() -> None:
    log = DrawLog()
    with Streams(seed=1, log=log).drawing(0, 0, replay=False, flags=(True,)):
        pass  # watched under the mode: learns that stage 0 draws nothing
    assert log.quiet(0, (True,)) and not log.quiet(0, (False,))
    before = torch.get_rng_state()
    with Streams(seed=1, log=log).drawing(0, 1, replay=True, flags=(True,)):
        torch.rand(2)  # will be replayed: still on the stream, the generator untouched
    assert torch.equal(torch.get_rng_state(), before) and log.quiet(0, (True,)) is False


class _OntoMeta(torch.overrides.TorchFunctionMode):
    """Moves every tensor an operation is given, as a model's stage on a GPU moves the
    caller's CPU tensors onto its device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **(kwargs or {}))


def test_a_quiet_stage_under_a_mode_that_moves_tensors_reads_the_generators_on_the_cpu() -> None:
    log = DrawLog()
    with Streams(seed=1, log=log).drawing(0, 0, replay=False, flags=(True,)):
        pass  # learns that stage 0 draws nothing: its next mini-batch's blocks are only watched
    streams = Streams(seed=1, log=log)
    with _OntoMeta():
        with streams.drawing(0, 1, replay=False, flags=(True,)):
            torch.zeros(2)
        streams.close()
    assert log.quiet(0, (True,))


def _quiet_log(*stages: int) -> DrawLog:
    log = DrawLog()
    for stage in stages:
        log.saw(stage, (True,), drew=False)
    return log


def test_a_quiet_block_that_draws_is_found_when_the_mini_batch_closes() -> None:
    log = _quiet_log(0, 1)
    streams = Streams(log=log)
    with streams.drawing(0, 0, replay=False, flags=(True,)):
        pass
    with streams.drawing(1, 0, replay=False, flags=(True,)):
        torch.rand(2)  # a quiet stage draws from the shared generator
    assert log.quiet(1, (True,))  # nothing is known before the mini-batch ends
    with pytest.warns(RuntimeWarning, match="stage 0 or 1 drew random numbers"):
        streams.close()
    assert not log.quiet(0, (True,)) and not log.quiet(1, (True,))
    streams.close()  # closed already: nothing more to say


def test_a_draw_before_pipepars_own_seed_is_not_taken_for_the_seed() -> None:
    log = _quiet_log(1)  # stage 0 has not run yet: it runs under the mode and draws the seed
    streams = Streams(log=log, flags={0: (True,), 1: (True,)})
    with streams.drawing(1, 0, replay=False, flags=(True,)):
        torch.rand(2)  # the quiet stage draws, then stage 0 takes the mini-batch's seed
    with streams.drawing(0, 0, replay=False, flags=(True,)):
        torch.rand(2)
    with pytest.warns(RuntimeWarning, match="stage 1 drew"):
        streams.close()
    assert not log.quiet(1, (True,)) and log.quiet(0, (True,)) is False


def test_pipepars_own_seed_during_quiet_blocks_is_no_draw_of_theirs() -> None:
    log = _quiet_log(1)
    streams = Streams(log=log, flags={0: (True,), 1: (True,)})
    with (
        streams.drawing(1, 0, replay=False, flags=(True,)),
        streams.drawing(0, 0, replay=False, flags=(True,)),
    ):
        torch.rand(2)  # stage 0 (not known quiet) draws on its stream: the seed is taken
    before = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streams.close()
    assert log.quiet(1, (True,)) and torch.equal(torch.get_rng_state(), before)


def test_a_mini_batch_reads_the_generators_twice_however_many_quiet_blocks_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = []
    original = randomness._fingerprints
    monkeypatch.setattr(randomness, "_fingerprints", lambda **kw: reads.append(1) or original(**kw))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    pipe = pipepar.wrap(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    x = torch.randn(8, WIDTH)
    for _ in range(3):
        pipe.step(x, torch.zeros(8, WIDTH), F.mse_loss)
    # the first step learns that both stages are quiet; each later step watches 8 blocks
    assert len(reads) == 4
