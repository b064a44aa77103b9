"""Lay out a module whose forward is a plain chain of its children as an ``nn.Sequential``.

A pipeline splits an ``nn.Sequential`` by layer index, so models written as a class (like
torchvision's AlexNet, VGG and ResNet) need a sequential layout first. :func:`sequentialize`
traces the module's forward with ``torch.fx``, each child being one opaque call, and accepts it
when the values flow in one line: input -> child or function -> ... -> output. Then:

- a child that is an ``nn.Sequential``, or that is itself a chain, is expanded into its layers,
  so a split may fall between them (torchvision ResNet: stem layers, then every block);
- a child that is not a chain (a residual block) stays one layer, run by its own forward;
- a function on the way (``torch.flatten(x, 1)``, ``F.adaptive_avg_pool2d(x, 1)``) becomes a
  parameter-free layer: ``nn.Flatten`` for flatten, a :class:`FunctionLayer` otherwise.

The layers are the original module objects, so the result shares every parameter and buffer
with the input: training one trains the other. Its layers are indexed (``result[3]``), but its
``named_parameters()``, ``named_buffers()`` and ``state_dict()`` use the model's own names
(``layer1.0.conv1.weight``), and ``load_state_dict`` takes them: checkpoints of the model and of
its layout load into each other.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["FunctionLayer", "Sequentialized", "sequentialize"]

logger = logging.getLogger(__name__)

# Functions whose behaviour hangs on ``self.training``: fx freezes that flag at trace time,
# so a layer built from the trace would stay in train (or eval) mode forever.
_MODE_DEPENDENT = {
    "alpha_dropout",
    "batch_norm",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "feature_alpha_dropout",
    "instance_norm",
    "rrelu",
}


class FunctionLayer(nn.Module):
    """A parameter-free layer that applies ``fn(x, *args, **kwargs)`` to its one input.

    ``fn`` is a function or the name of a ``torch.Tensor`` method (``"view"``, ``"mean"``).
    :func:`sequentialize` makes these from the functional calls of a traced forward.

    Example:
        >>> layer = FunctionLayer(torch.nn.functional.adaptive_avg_pool2d, (1, 1))
        >>> layer(torch.randn(2, 8, 5, 5)).shape
        torch.Size([2, 8, 1, 1])
    """

    def __init__(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.fn, str):
            return getattr(x, self.fn)(*self.args, **self.kwargs)
        return self.fn(x, *self.args, **self.kwargs)

    def extra_repr(self) -> str:
        name = self.fn if isinstance(self.fn, str) else _qualified_name(self.fn)
        options = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return ", ".join([name, *options])


class _NotAChain(Exception):
    """Why a module's forward is not a plain chain (internal; becomes a TypeError at the top)."""


class _ChildTracer(torch.fx.Tracer):
    # Every submodule is one opaque call: we look at how the root wires its children.
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


class Sequentialized(nn.Sequential):
    """The ``nn.Sequential`` :func:`sequentialize` makes: indexed layers, the model's names.

    Args:
        layers: the layers, in order (or an ``OrderedDict``, as for ``nn.Sequential``).
        paths: each layer's module path in the model (``""`` for a layer pipepar made, such as
            a :class:`FunctionLayer`, which holds no tensors).
    """

    def __init__(self, *layers: Any, paths: list[str] | None = None) -> None:
        super().__init__(*layers)  # also as nn.Sequential builds a slice: one OrderedDict
        self._paths = {str(k): p for k, p in enumerate(paths or []) if p}
        self._indices = {p: k for k, p in self._paths.items()}
        self._register_state_dict_hook(_to_model_names)
        self._register_load_state_dict_pre_hook(_from_model_names, with_module=True)

    def model_name(self, name: str) -> str:
        """``"3.weight"`` -> ``"layer1.0.conv1.weight"``: a tensor's name in the model."""
        head, dot, rest = name.partition(".")
        path = self._paths.get(head)
        return f"{path}{dot}{rest}" if path is not None else name

    def index_name(self, name: str) -> str:
        """The inverse of :meth:`model_name`."""
        for path, index in self._indices.items():
            if name.startswith(path + "."):
                return index + name[len(path) :]
        return name

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return ((self.model_name(n), p) for n, p in super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return ((self.model_name(n), b) for n, b in super().named_buffers(*args, **kwargs))


def _to_model_names(module: Sequentialized, state: dict[str, Any], prefix: str, meta: Any) -> None:
    for key in [k for k in state if k.startswith(prefix)]:
        renamed = prefix + module.model_name(key[len(prefix) :])
        if renamed != key:
            state[renamed] = state.pop(key)


def _from_model_names(
    module: Sequentialized, state: dict[str, Any], prefix: str, *rest: Any
) -> None:
    for key in [k for k in state if k.startswith(prefix)]:
        renamed = prefix + module.index_name(key[len(prefix) :])
        if renamed != key:
            state[renamed] = state.pop(key)


def sequentialize(module: nn.Module) -> nn.Sequential:
    """Lay out ``module`` as an ``nn.Sequential`` with the same parameters and outputs.

    Works for torchvision's AlexNet, VGG and ResNet (any variant), any ``nn.Sequential``
    (nested ones are flattened) and any module whose forward is a plain chain of its children
    and simple functions. Residual blocks and other non-chain children stay whole layers.

    Args:
        module: The model. Its parameters are shared, not copied.

    Returns:
        An ``nn.Sequential`` of the original layers (plus ``nn.Flatten`` / :class:`FunctionLayer`
        for functional calls), in the module's train/eval mode.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or its forward is not a plain chain
            (branches, several inputs or outputs, parameters used outside a child, control flow
            on tensor values); write the ``nn.Sequential`` by hand then.

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18(weights=None)
        >>> layers = sequentialize(model)
        >>> len(layers)  # conv1, bn1, relu, maxpool, 8 blocks, avgpool, flatten, fc
        15
        >>> layers[0] is model.conv1
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be an nn.Module, got {type(module).__name__}; "
            "pass the model itself, e.g. sequentialize(torchvision.models.alexnet())"
        )
    try:
        layers = _unique(_chain(module))
    except _NotAChain as exc:
        name = type(module).__name__
        raise TypeError(
            f"cannot lay out {name} as an nn.Sequential: {exc}. pipepar splits only plain "
            "chains of layers; write the model as an nn.Sequential by hand (keep a branching "
            "part such as a residual block as one layer whose forward takes and returns one "
            "tensor)"
        ) from exc
    paths = {id(m): name for name, m in module.named_modules() if name}
    result = Sequentialized(*layers, paths=[paths.get(id(layer), "") for layer in layers])
    result.training = module.training
    logger.debug("sequentialize(%s): %d layers", type(module).__name__, len(result))
    return result


def _chain(module: nn.Module) -> list[nn.Module]:
    """The layers that ``module``'s forward runs one after another; raises ``_NotAChain``."""
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        return [layer for child in module for layer in _expand(child)]
    if module._forward_hooks or module._forward_pre_hooks:
        raise _NotAChain("it has forward hooks, which a layout would drop")
    try:
        graph = _ChildTracer().trace(module)
    except Exception as exc:
        raise _NotAChain(f"torch.fx cannot trace its forward ({exc})") from exc
    layers = _walk(graph, module)
    _check_covers(module, layers)
    _unique(layers)  # refuses weights called twice, so such a child stays one layer
    return layers


def _expand(child: nn.Module) -> list[nn.Module]:
    """``child``'s own layers when it is a chain, else ``[child]`` (run by its own forward)."""
    if not isinstance(child, nn.Sequential) and not any(True for _ in child.children()):
        return [child]
    try:
        return _chain(child)
    except _NotAChain:
        return [child]


def _walk(graph: torch.fx.Graph, root: nn.Module) -> list[nn.Module]:
    """Follow the single value from the input to the output, collecting one layer per node."""
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder" and n.users]
    if len(inputs) != 1:
        raise _NotAChain(f"its forward uses {len(inputs)} inputs, not one tensor")
    current = inputs[0]
    layers: list[nn.Module] = []
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if node.args[0] is not current:
                raise _NotAChain("its forward does not return the last layer's output alone")
            return layers
        if node.op == "get_attr":
            raise _NotAChain(f"its forward reads '{node.target}' directly, not through a child")
        if len(current.users) != 1:
            raise _NotAChain(f"the value '{current.name}' feeds several operations (a branch)")
        if node.all_input_nodes != [current]:
            raise _NotAChain(f"'{node.name}' combines several values")
        layers.extend(_layer_of(node, current, root))
        current = node
    raise _NotAChain("its forward has no output")


def _layer_of(node: torch.fx.Node, current: torch.fx.Node, root: nn.Module) -> list[nn.Module]:
    if node.op == "call_module":
        if node.args != (current,) or node.kwargs:
            raise _NotAChain(f"child '{node.target}' is called with more than one argument")
        return _expand(root.get_submodule(str(node.target)))
    return [_function_layer(node, current)]


def _function_layer(node: torch.fx.Node, current: torch.fx.Node) -> nn.Module:
    """A layer for a functional call whose first argument is the chain's value."""
    args, kwargs = node.args[1:], dict(node.kwargs)
    if not node.args or node.args[0] is not current or _holds_node((args, kwargs)):
        raise _NotAChain(f"'{node.name}' does not take the chain's value as its only tensor")
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name in _MODE_DEPENDENT or "training" in kwargs:
        raise _NotAChain(f"'{name}' depends on train/eval mode; use its nn.Module instead")
    if name == "flatten":
        return _flatten(args, kwargs)
    return FunctionLayer(node.target, *args, **kwargs)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    # torch.flatten defaults to start_dim=0, nn.Flatten to 1: pass both explicitly.
    values = dict(zip(("start_dim", "end_dim"), args, strict=False)) | kwargs
    return nn.Flatten(values.get("start_dim", 0), values.get("end_dim", -1))


def _holds_node(value: Any) -> bool:
    found: list[bool] = []
    torch.fx.node.map_aggregate(value, lambda v: found.append(isinstance(v, torch.fx.Node)))
    return any(found)


def _check_covers(module: nn.Module, layers: list[nn.Module]) -> None:
    """Refuse a layout that would drop parameters or buffers the module owns."""
    kept = {id(t) for layer in layers for t in _tensors(layer)}
    named = list(module.named_parameters()) + list(module.named_buffers())
    lost = [name for name, t in named if id(t) not in kept]
    if lost:
        raise _NotAChain(f"its forward does not use {', '.join(lost[:3])} through a child")


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


def _unique(layers: list[nn.Module]) -> list[nn.Module]:
    """Copy a stateless layer used twice (one ReLU called at two places); refuse weights."""
    seen: set[int] = set()
    result = []
    for layer in layers:
        if id(layer) in seen:
            if _tensors(layer):
                raise _NotAChain(
                    f"one {type(layer).__name__} holding parameters is called twice, and a "
                    "pipeline cannot place one set of weights on two stages"
                )
            layer = copy.deepcopy(layer)
        seen.add(id(layer))
        result.append(layer)
    return result


def _qualified_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    return f"{module}.{name}" if module else name
