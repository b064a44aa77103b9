"""Whether an operation mixes rows of the batch, decided from its numbers, and what the probe says.

A pipe runs each micro-batch on its own rows. An operation ``f`` is row-wise when ``f`` on the
whole batch equals the results of ``f`` on each half of it, joined along one dimension of the
result; otherwise it mixes rows (its result on a micro-batch is not a part of the whole's). The
probe (:class:`pipepar.core.reductions.Probe`) must say the same: an operation that mixes rows is
refused (:class:`pipepar.BatchCoupled`), a row-wise one is followed (the probe knows which
dimension of its result holds the rows) and not refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipepar.core.forms import Rows, is_reduced
from pipepar.core.reductions import BatchCoupled, Probe

Op = Callable[[Tensor], Any]


def _leaves(value: Any) -> list[Tensor]:
    """The tensors of a result (a tensor, a tuple of them, a named tuple, a packed sequence)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []


def row_dims(whole: Tensor, halves: list[Tensor]) -> list[int]:
    """The dimensions of ``whole`` along which the halves' results join into it."""
    found = []
    for k in range(whole.dim()):
        if any(h.dim() != whole.dim() for h in halves):
            break
        if any(
            h.shape[:k] + h.shape[k + 1 :] != whole.shape[:k] + whole.shape[k + 1 :] for h in halves
        ):
            continue
        joined = torch.cat(halves, k)
        if joined.shape == whole.shape and torch.allclose(joined, whole, atol=1e-5, equal_nan=True):
            found.append(k)
    return found


def mixes_rows(f: Op, x: Tensor) -> bool:
    """Whether ``f`` on the whole of ``x`` differs from ``f`` on each half of its rows, joined."""
    whole = _leaves(f(x.clone()))
    try:
        parts = [_leaves(f(h.clone())) for h in x.chunk(2, 0)]
    except (RuntimeError, IndexError, ValueError):
        return True  # a micro-batch cannot even compute it: it needs rows of the others
    if any(len(p) != len(whole) for p in parts):
        return True
    for k, w in enumerate(whole):
        halves = [p[k] for p in parts]
        if w.dim() == 0 or not row_dims(w, halves):
            return True
    return False


@dataclass(frozen=True)
class Verdict:
    """What the probe said about ``f``: refused (and why), or the rows' dimension in each
    tensor of its result (None where it lost them), and whether the result is one value
    reduced over the batch (a loss: how micro-batches join it is the forms' business)."""

    refused: str | None
    dims: list[int | None]
    reduced: bool = False


def probe(f: Op, x: Tensor) -> Verdict:
    """Run ``f`` on ``x`` under a probe watching ``x``'s rows."""
    x = x.clone()
    try:
        with Probe([x], rows=x.shape[0]) as watching:
            out = f(x)
    except BatchCoupled as error:
        return Verdict(str(error), [])
    forms = [watching.form_of(t) for t in _leaves(out)]
    dims = [form.dim if isinstance(form, Rows) else None for form in forms]
    return Verdict(None, dims, reduced=any(is_reduced(form) for form in forms))


def disagreement(f: Op, x: Tensor) -> str | None:
    """Why the probe and the numbers disagree on ``f`` (None when they agree)."""
    verdict = probe(f, x)
    if mixes_rows(f, x):
        if verdict.refused is None and not verdict.reduced:
            return f"mixes rows, but the probe followed it (rows at {verdict.dims})"
        return None
    if verdict.refused is not None:
        return f"row-wise, but the probe refused it: {verdict.refused[:200]}"
    whole = _leaves(f(x.clone()))
    parts = [_leaves(f(h.clone())) for h in x.chunk(2, 0)]
    for k, (w, d) in enumerate(zip(whole, verdict.dims)):
        right = row_dims(w, [p[k] for p in parts])
        if d not in right:
            return f"row-wise, but the probe put the rows of result {k} on {d}, not {right}"
    return None


# -- every function torch lets a mode see, on one operand ---------------------------------------
_DRAWS = (
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "poisson",
    "multinomial",
    "gumbel",
    "uniform",
    "binomial",
)
_UNSAFE = ("as_strided", "empty", "fractional_max_pool", "exponential", "set_", "resize_")


def _public_functions() -> list[tuple[str, Callable[..., Any]]]:
    """Every public function torch lets a torch-function mode see
    (``torch.overrides.get_testing_overrides``), random ones left out, with a label."""
    found = []
    for f in torch.overrides.get_testing_overrides():
        name = getattr(f, "__name__", "")
        if not name or name.startswith("_") or name.endswith("_"):
            continue
        where = getattr(f, "__module__", None) or "Tensor"
        if not any(w in name for w in _DRAWS + _UNSAFE) and "distributed" not in where:
            found.append((f"{where}.{name}", f))
    return found


def _one_operand_calls() -> list[tuple[str, Op]]:
    """``f(x)`` and ``f(x, k)`` (k: 0, -1, 1) for every public function."""
    extras: list[tuple[int, ...]] = [(), (0,), (-1,), (1,)]
    return [(f"{label}{e}", _with(f, e)) for label, f in _public_functions() for e in extras]


def _two_operand_calls() -> list[tuple[str, Op]]:
    """``f(x, y)`` and ``f(x, y, k)`` (``y`` another value of the rows, k: 0, -1), and
    ``f(x, w)`` (``w`` a constant vector) for every public function."""
    w = torch.randn(8)
    calls = []
    for label, f in _public_functions():
        for e in [(), (0,), (-1,)]:
            calls.append((f"{label}(x, y, *{e})", _paired(f, lambda t: t.exp() * 0.5 + 0.1, e)))
        calls.append((f"{label}(x, w)", _paired(f, lambda t: w, ())))
    return calls


def _paired(f: Callable[..., Any], other: Callable[[Tensor], Any], extra: tuple[int, ...]) -> Op:
    return lambda t: f(t, other(t), *extra)


def _with(f: Callable[..., Any], extra: tuple[int, ...]) -> Op:
    return lambda t: f(t, *extra)


def _runs_on_floats(f: Op, x: Tensor) -> bool:
    """Whether ``f(x)`` runs, gives floating tensors, and gives them twice the same."""
    try:
        with torch.no_grad():
            first, again = _leaves(f(x.clone())), _leaves(f(x.clone()))
    except Exception:  # most functions do not take these arguments
        return False
    if not first or not all(t.is_floating_point() or t.is_complex() for t in first):
        return False
    if any(t.layout != torch.strided for t in first):
        return False  # sparse: compared by other means
    return all(
        a.shape == b.shape and torch.allclose(a, b, equal_nan=True) for a, b in zip(first, again)
    )


def sweep(x: Tensor, operands: int = 1) -> dict[str, str]:
    """Every disagreement between the probe and the numbers over the calls of every public
    torch function on one operand holding rows (and an argument) or two."""
    found = {}
    for label, f in _one_operand_calls() if operands == 1 else _two_operand_calls():
        if _runs_on_floats(f, x):
            problem = disagreement(f, x)
            if problem is not None:
                found[label] = problem
    return found
