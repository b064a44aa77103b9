"""torch.compile through the pipe: each unit's ``forward`` compiled, the pipe's hooks and
modes outside the compiled code.

A module compiled before it is wrapped (``block.compile()``, ``torch.compile(block)`` put in
its parent's place, or ``torch.compile(model)``) compiles its ``__call__``: its forward hooks
run inside the compiled frame. The pipe's unit hooks and the torch-function modes that watch
every operation on a first call (the cut, the probe) would then be traced into the graph:
guards on tensor ids and counters, a recompile on every call until Dynamo's limit, then eager
code without a word, and operations the modes never saw. So the pipe takes the compilation
over (:func:`take_compiled`, before anything runs the model), keeping the user's compile
context as it is (backend, mode, dynamic, fullgraph, options), and puts it back one level down
(:func:`compile_units`): a unit's ``forward`` alone is compiled, so its hooks run in Python
around the compiled code. A compiled module that holds units (the whole model) cannot stay one
compiled call once it is cut into stages: each unit under it is compiled with its context.

While a mode that must see every operation is active on the calling thread (a first call's
cut, the probe, a shadow stage's meta mode), a compiled forward runs its eager code: the same
operations, which the mode watches as it does for a plain model. Later calls run the compiled
code. Modes that torch.compile traces itself (``torch.device`` as a context) do not count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["CompileOption", "Compiler", "compile_units", "compiler_of", "take_compiled"]

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Makes the compiled version of a function (a Dynamo context, or ``torch.compile`` with the
user's keyword arguments bound)."""

CompileOption = bool | Mapping[str, Any] | None
"""``wrap(compile=...)``: True (``torch.compile``'s defaults), a dict of its keyword
arguments, or False / None (only what the user compiled)."""

_TRACED_MODES = (DeviceContext,)
"""Torch-function modes torch.compile traces itself: they do not make a unit run eagerly."""


def compiler_of(option: CompileOption) -> Compiler | None:
    """The compiler ``wrap(compile=option)`` asks for, or None; a TypeError for another type.

    Example:
        >>> compiler_of(None) is None
        True
        >>> compiler_of({"backend": "eager"}) is not None
        True
    """
    if option is None or option is False:
        return None
    if option is True:
        return torch.compile
    if isinstance(option, Mapping):
        return functools.partial(torch.compile, **dict(option))
    raise TypeError(
        f"compile must be True, False or a dict of torch.compile keyword arguments, got "
        f"{type(option).__name__} {option!r}; pass e.g. compile={{'backend': 'inductor'}}"
    )


def take_compiled(model: nn.Module) -> tuple[nn.Module, dict[nn.Module, Compiler]]:
    """``model`` with every compilation taken off it, and each compiled module's compiler.

    An ``OptimizedModule`` (``torch.compile(module)``) is replaced by the module it wraps (in
    its parent, or returned for ``model`` itself), so units, ``split=`` and state-dict keys
    use the model's own names; a module compiled in place (``module.compile()``) is called
    plainly again. :func:`compile_units` compiles the units with what this returns.
    """
    compilers: dict[nn.Module, Compiler] = {}
    if not isinstance(model, nn.Module):  # the wrapper's own check names what it is
        return model, compilers
    model = _unwrapped(model, compilers)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            inner = _unwrapped(child, compilers)
            if inner is not child:
                setattr(parent, name, inner)
    for module in model.modules():
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is not None:
            compilers[module] = _context_of(compiled, module)
            module._compiled_call_impl = None
    return model, compilers


def _unwrapped(module: nn.Module, compilers: dict[nn.Module, Compiler]) -> nn.Module:
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        inner = module._orig_mod
        assert isinstance(inner, nn.Module)
        compilers.setdefault(inner, module.dynamo_ctx)
        module = inner
    return module


def _context_of(compiled: Callable[..., Any], module: nn.Module) -> Compiler:
    """The Dynamo context ``module.compile(...)`` made (the compiled function holds it)."""
    context = torch._dynamo.eval_frame._TorchDynamoContext
    for cell in getattr(compiled, "__closure__", None) or ():
        if isinstance(cell.cell_contents, context):
            return cell.cell_contents  # type: ignore[no-any-return]
    raise TypeError(
        f"{type(module).__name__}._compiled_call_impl is {compiled!r}, not a function "
        "torch.compile made, so pipepar cannot compile the units with the same options; "
        "wrap the module uncompiled and pass compile={...} (torch.compile's arguments)"
    )


def compile_units(
    units: Sequence[nn.Module],
    compilers: Mapping[nn.Module, Compiler],
    default: Compiler | None,
    model: nn.Module,
) -> list[nn.Module]:
    """Compile each unit's ``forward`` (and a compiled module's inside a unit) with its
    compiler: its own, else a compiled ancestor's, else ``default``; the modules compiled."""
    unit_set = set(units)
    ancestors = _ancestors(model, unit_set)
    done = []
    for module in units:
        compiler = compilers.get(module) or _nearest(ancestors[module], compilers) or default
        if compiler is not None:
            _install(module, compiler)
            done.append(module)
    for module, compiler in compilers.items():
        if module not in unit_set and _inside(module, units):
            _install(module, compiler)
            done.append(module)
    return done


def _ancestors(model: nn.Module, units: set[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """Each unit's enclosing modules, nearest first."""
    found: dict[nn.Module, list[nn.Module]] = {}

    def walk(module: nn.Module, above: list[nn.Module]) -> None:
        if module in units:
            found.setdefault(module, list(reversed(above)))
            return
        for child in module.children():
            walk(child, [*above, module])

    walk(model, [])
    return found


def _nearest(modules: Iterable[nn.Module], compilers: Mapping[nn.Module, Compiler]) -> Any:
    return next((compilers[m] for m in modules if m in compilers), None)


def _inside(module: nn.Module, units: Sequence[nn.Module]) -> bool:
    return any(module is not u and any(m is module for m in u.modules()) for u in units)


def _install(module: nn.Module, compiler: Compiler) -> None:
    eager = type(module).forward.__get__(module)
    module.forward = _UnitForward(eager, compiler(eager))  # type: ignore[method-assign]


class _UnitForward:
    """A unit's forward: the compiled code, or the eager one under a watching mode."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.eager = eager
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if watched():
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def watched() -> bool:
    """Whether a mode that must see every operation is active on this thread."""
    if _get_current_dispatch_mode_stack():
        return True
    return any(not isinstance(m, _TRACED_MODES) for m in _get_current_function_mode_stack())
