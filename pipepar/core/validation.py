"""Checks of what users pass to :func:`pipepar.wrap`, with messages that say how to fix it."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from torch import nn

from pipepar.core.recompute import MODES

__all__ = [
    "check_balance",
    "check_checkpoint",
    "check_chunks",
    "check_offload",
    "check_model",
    "check_shared_parameters",
    "check_unique_layers",
]


def check_model(module: object, name: str = "module") -> nn.Sequential:
    """The argument called ``name`` must be a non-empty ``nn.Sequential``."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"{name} must be an nn.Sequential, but got {type(module).__name__}; lay it out as one "
            f"with pipepar.sequentialize({name}) or nn.Sequential(*layers)"
        )
    if len(module) == 0:
        raise ValueError(f"{name} is an empty nn.Sequential (0 layers); give it at least one layer")
    return module


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_balance(balance: object, n_layers: int) -> list[int]:
    """Balance: positive ints, one per stage, summing to the number of layers."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(
            f"balance must be a list of ints (layers per stage), but got {balance!r}; "
            f"e.g. balance=[{n_layers}] for one stage"
        )
    if len(balance) == 0:
        raise ValueError(f"balance is empty; give at least one stage, e.g. balance=[{n_layers}]")
    for j, size in enumerate(balance):
        if not _is_int(size):
            raise TypeError(
                f"balance[{j}] must be an int, but got {size!r} ({type(size).__name__}); "
                f"pass whole layer counts like {[int(n_layers // len(balance))] * len(balance)}"
            )
        if size < 1:
            raise ValueError(
                f"balance[{j}] is {size} but every stage needs at least 1 layer; "
                "drop the empty stage or move a layer into it"
            )
    total = sum(int(b) for b in balance)
    if total != n_layers:
        raise ValueError(
            f"balance {list(balance)} sums to {total} but the model has {n_layers} layers; fix the "
            "counts, or pass balance=None with sample=... to profile and plan it"
        )
    return [int(b) for b in balance]


def check_chunks(chunks: object) -> int:
    """Chunks: an int of at least 1."""
    if not _is_int(chunks):
        raise TypeError(f"chunks must be an int, but got {chunks!r}; e.g. chunks=8")
    if chunks < 1:  # type: ignore[operator]
        raise ValueError(f"chunks must be at least 1, but got {chunks}; use chunks=1 to disable it")
    return int(chunks)  # type: ignore[call-overload]


def check_offload(offload: object) -> bool:
    """Offload: True or False."""
    if not isinstance(offload, bool):
        raise TypeError(
            f"offload must be True or False, but got {offload!r}; offload=True sends saved "
            "activations to host memory between a micro-batch's forward and its backward"
        )
    return offload


def check_checkpoint(checkpoint: object) -> str:
    """Checkpoint: one of ``MODES``, or any object whose ``str()`` is one (torchgpipe takes
    ``str(checkpoint)``); returned as the plain ``str`` of the mode.

    >>> class Mode:
    ...     def __str__(self) -> str:
    ...         return "never"
    >>> check_checkpoint(Mode())
    'never'
    """
    text = str(checkpoint)
    if text in MODES:
        return MODES[MODES.index(text)]
    if isinstance(checkpoint, str) and checkpoint in MODES:  # a str enum whose str() differs
        return MODES[MODES.index(checkpoint)]
    plain = isinstance(checkpoint, str) or text == repr(checkpoint)
    shown = repr(checkpoint) if plain else f"{checkpoint!r} (whose str() is {text!r})"
    raise ValueError(
        f"checkpoint must be one of {', '.join(repr(m) for m in MODES)} (or an object whose "
        f"str() is one), but got {shown}; 'except_last' is the usual choice"
    )


def check_unique_layers(module: nn.Sequential) -> None:
    """The same module object may not appear at two positions (it would run on two stages)."""
    seen: dict[int, int] = {}
    for i, layer in enumerate(module):
        if id(layer) in seen:
            raise ValueError(
                f"layer {i} is the same module object as layer {seen[id(layer)]} "
                f"({type(layer).__name__}); use copy.deepcopy(layer) for a second independent one, "
                "or one layer that runs twice in its forward"
            )
        seen[id(layer)] = i


def check_shared_parameters(module: nn.Sequential, balance: Sequence[int]) -> None:
    """No parameter or buffer may be held by layers of two different stages."""
    owner: dict[int, tuple[int, str]] = {}
    start = 0
    for j, size in enumerate(balance):
        for i in range(start, start + size):
            for name, tensor in _tensors_of(module[i]):
                first = owner.setdefault(id(tensor), (j, f"{i}.{name}"))
                if first[0] != j:
                    raise ValueError(
                        f"parameter {first[1]} (stage {first[0]}) is shared with {i}.{name} "
                        f"(stage {j}); a tensor can live on one device only: change balance so "
                        "both layers fall in the same stage, or untie the weights"
                    )
        start += size


def _tensors_of(layer: nn.Module) -> list[tuple[str, object]]:
    params = list(layer.named_parameters(remove_duplicate=False))
    return params + list(layer.named_buffers(remove_duplicate=False))
