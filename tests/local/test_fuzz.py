"""Property-based: any stack, balance, chunk count, batch size and checkpoint mode is transparent.

Each example runs under a watchdog: a hang fails the test with every thread's stack instead of
stalling CI.
"""

from __future__ import annotations

import copy
import faulthandler
import random
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipepar
from tests._stacks import WIDTH, random_balance, random_stack


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, int, int, int, int, str]:
    n_layers = draw(st.integers(1, 8))
    n_stages = draw(st.integers(1, min(4, n_layers)))
    return (
        draw(st.integers(0, 2**16)),
        n_layers,
        n_stages,
        draw(st.integers(1, 20)),
        draw(st.integers(0, 17)),
        draw(st.sampled_from(["always", "except_last", "never"])),
    )


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_transparent_and_never_hangs(case: tuple[int, int, int, int, int, str]) -> None:
    seed, n_layers, n_stages, chunks, batch, checkpoint = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = random_stack(rng, n_layers).double()
    plain = copy.deepcopy(model)
    balance = random_balance(rng, n_layers, n_stages) if n_stages > 1 else [n_layers]
    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)
    try:
        pipe = pipepar.wrap(
            model, balance, devices=["cpu"] * n_stages, chunks=chunks, checkpoint=checkpoint
        )
        x = torch.randn(batch, WIDTH, dtype=torch.float64)
        got, expected = pipe(x), plain(x)
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-7)
        got.square().sum().backward()
        expected.square().sum().backward()
        for a, b in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-9, rtol=1e-7)
        pipe.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
