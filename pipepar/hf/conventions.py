"""What Hugging Face's ``Trainer`` and ``accelerate`` read from a model, answered for a pipe.

Both look at a model before they run it, and a pipe must answer as the model would, or as a
model placed on its devices would:

- the parameters of ``type(model).forward`` choose the dataset columns Trainer keeps
  (``remove_unused_columns``), the label names (``find_labels``) and whether the model takes
  ``num_items_in_batch`` (a ``**kwargs`` parameter), and the class's name matters too
  (``find_labels`` looks for ``QuestionAnswering``, label smoothing for a causal LM's name):
  a pipe's class is one made per model class by :func:`class_for`. A model whose ``forward``
  only passes ``*args, **kwargs`` on to its one child (an adapter's wrapper such as PEFT's
  ``PeftModel`` without a task type, which Trainer looks through by name) is described by
  the class that takes the call (:func:`signing_class`), as Trainer describes it;
- ``hf_device_map`` (module path -> device) says the model is placed already: Trainer then
  does not move it, and where it spans several devices treats it as model-parallel (no
  ``DataParallel``); accelerate does not move it either: :func:`device_map`;
- ``is_parallelizable`` and ``model_parallel`` say "model-parallel" to older versions:
  :func:`spans_devices`.

Everything else (``config``, ``loss_type``, ``main_input_name``, ``get_input_embeddings``...)
is the wrapped model's own (see ``Pipe.__getattr__``). This module imports neither
transformers nor accelerate: it only follows their conventions.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["class_for", "device_map", "forward_signature", "signing_class", "spans_devices"]

W = TypeVar("W", bound=nn.Module)

_CLASSES: dict[tuple[type[nn.Module], type[nn.Module], type[nn.Module]], Any] = {}


def class_for(
    base: type[W], model_class: type[nn.Module], signed: type[nn.Module] | None = None
) -> type[W]:
    """The subclass of ``base`` (a wrapper, e.g. ``Pipe``) for wrappers of ``model_class``,
    made once per model class: named as ``signed`` (default ``model_class``; its
    ``__qualname__`` is ``Base[Model]``), with a ``forward`` that calls ``base.forward`` and
    whose signature, read off the class as Trainer reads it, is ``signed.forward``'s. ``base``
    itself where that signature cannot be read. The class's ``_model_class`` names the model
    class, its ``_signed_class`` the class it is signed as.

    Example:
        >>> made = class_for(Pipe, GPT2LMHeadModel)
        >>> made.__name__, list(inspect.signature(made.forward).parameters)[:2]
        ('GPT2LMHeadModel', ['self', 'input_ids'])
    """
    signed = signed or model_class
    made = _CLASSES.get((base, model_class, signed))
    if made is None:  # two threads may both make one; the first stored is kept
        made = _CLASSES.setdefault(
            (base, model_class, signed), _made_for(base, model_class, signed)
        )
    return made  # type: ignore[no-any-return]


def _made_for(base: type[W], model_class: type[nn.Module], signed: type[nn.Module]) -> type[W]:
    signature = forward_signature(signed)
    if signature is None:
        return base
    qualname = f"{base.__qualname__}[{model_class.__qualname__}]"

    def forward(self: W, *args: Any, **kwargs: Any) -> Any:
        return base.forward(self, *args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = base.forward.__doc__
    forward.__qualname__ = f"{qualname}.forward"
    namespace = {
        "forward": forward,
        "_model_class": model_class,
        "_signed_class": signed,
        "__module__": base.__module__,
        "__qualname__": qualname,
        "__doc__": base.__doc__,
    }
    return type(signed.__name__, (base,), namespace)


def signing_class(model: nn.Module) -> type[nn.Module]:
    """The class whose ``forward`` describes a call of ``model``: its own, unless it takes
    nothing but ``*args`` and ``**kwargs`` and ``model`` has one child, to which such a
    forward can only pass the call on; then the child's, followed the same way.

    Example:
        >>> class Wrapper(nn.Module):
        ...     def __init__(self, inner): super().__init__(); self.inner = inner
        ...     def forward(self, *args, **kwargs): return self.inner(*args, **kwargs)
        >>> signing_class(Wrapper(nn.Linear(2, 2)))
        <class 'torch.nn.modules.linear.Linear'>
    """
    module = model
    while _passes_on(type(module)):
        children = list(module.children())
        if len(children) != 1:
            return type(model)
        module = children[0]
    return type(module)


def _passes_on(model_class: type[nn.Module]) -> bool:
    """Whether ``model_class.forward`` takes only ``self``, ``*args`` and ``**kwargs``."""
    signature = forward_signature(model_class)
    if signature is None:
        return False
    kinds = [p.kind for p in list(signature.parameters.values())[1:]]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return bool(kinds) and all(k in variadic for k in kinds)


def forward_signature(model_class: type[nn.Module]) -> inspect.Signature | None:
    """The signature of ``model_class.forward``, ``self`` included (as ``inspect.signature``
    reads it off the class), or None where it cannot be read (a builtin, say).

    Example:
        >>> list(forward_signature(nn.Linear).parameters)
        ['self', 'input']
    """
    try:
        return inspect.signature(model_class.forward)
    except (TypeError, ValueError):
        return None


def device_map(paths: Sequence[str], devices: Sequence[torch.device]) -> dict[str, int | str]:
    """transformers' ``hf_device_map`` of a pipe: each unit's module path -> its device.

    A CUDA device is written by its index and any other by its name, as
    ``from_pretrained(device_map=...)`` writes them (``{"transformer.h.0": 0, ...}``); a
    whole-model unit has the path ``""``.

    Example:
        >>> device_map(["embed", "head"], [torch.device("cuda:0"), torch.device("cuda:1")])
        {'embed': 0, 'head': 1}
    """
    if len(paths) != len(devices):
        raise ValueError(
            f"device_map needs one device per unit, but got {len(paths)} paths and "
            f"{len(devices)} devices; pass the stage device of every unit"
        )
    return {path: _written(device) for path, device in zip(paths, devices)}


def spans_devices(devices: Sequence[torch.device]) -> bool:
    """Whether the stages sit on more than one distinct device (model-parallel for Trainer).

    Example:
        >>> spans_devices([torch.device("cpu"), torch.device("cpu")])
        False
    """
    return len({_written(d) for d in devices}) > 1


def _written(device: torch.device) -> int | str:
    if device.type == "cuda" and device.index is not None:
        return device.index
    return str(device)
