"""Which torch operations are element-wise: each element of the result computed from the
elements at its place in the operands (broadcast), so the rows stay where broadcasting puts
them.

ATen tags its element-wise operations (``torch.Tag.pointwise``). An operation it does not tag
is element-wise when all it does is element-wise: an alias (``absolute``, ``special.expit``)
or a composite of tagged operations, found by running it once on ``meta`` copies of its
operands and watching the ATen operations it dispatches. A few more are known so: casts and
copies, Python's operators, losses without a reduction, random draws shaped as their operand.
Anything else is not element-wise here; :mod:`pipepar.core.batch_dims` then needs a rule for it
or refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

__all__ = ["elementwise"]


def elementwise(
    name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether ``func`` (named ``name``) computes each element from the elements at its place."""
    if name in _KNOWN or _tagged(name):
        return True
    key = (name, len(args))
    if key not in _COMPOSED:
        _COMPOSED[key] = _composed(func, args, kwargs)
    return _COMPOSED[key]


def _tagged(name: str) -> bool:
    if name not in _TAGGED:
        op = getattr(torch.ops.aten, name, None)
        overloads = [getattr(op, o) for o in op.overloads()] if op is not None else []
        _TAGGED[name] = any(torch.Tag.pointwise in o.tags for o in overloads)
    return _TAGGED[name]


class _Dispatched(TorchDispatchMode):
    """Records the ATen operations a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _composed(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` dispatches only element-wise ATen operations, run on ``meta``."""
    shapes = tree_map(
        lambda v: torch.empty_like(v, device="meta") if isinstance(v, Tensor) else v,
        (args, kwargs),
    )
    seen = _Dispatched()
    try:
        with _disable_current_modes(), seen:
            func(*shapes[0], **shapes[1])
    except Exception:  # an operation meta cannot run: not known element-wise
        return False
    return bool(seen.ops) and all(torch.Tag.pointwise in op.tags for op in seen.ops)


_TAGGED: dict[str, bool] = {}
_COMPOSED: dict[tuple[str, int], bool] = {}
_UNTAGGED = (
    # Not tagged element-wise by ATen: casts, copies, Python's operators, composite activations,
    # losses without a reduction, random draws shaped as their operand
    "to", "type", "type_as", "contiguous", "detach", "clone", "float", "double", "half",
    "bfloat16", "int", "long", "bool", "byte", "short", "char", "cpu", "cuda", "data",
    "requires_grad", "retain_grad", "pin_memory", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "copy", "fill", "zero", "real", "imag", "conj",
    "resolve_conj", "resolve_neg", "complex", "polar", "hardswish", "softsign", "tanhshrink",
    "logsigmoid", "and", "or", "xor", "invert", "lshift", "rshift", "rand", "ror", "rxor", "radd",
    "rmul", "rdiv", "rpow", "rfloordiv", "rmod", "mod", "pos", "abs", "dropout", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "expand", "expand_as",
    "broadcast_to", "masked_fill", "where", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss",
    "bernoulli", "uniform", "normal", "random", "exponential", "geometric", "cauchy", "log_normal",
    "poisson", "multinomial", "native_dropout", "rrelu_with_noise", "broadcast_tensors", "isin",
    "bucketize", "searchsorted", "cfloat", "cdouble", "chalf", "dequantize", "to_dense",
    "log_sigmoid", "alias",
)  # fmt: skip
_KNOWN = frozenset(_UNTAGGED)
