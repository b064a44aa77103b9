"""A look at a model that leaves it as it was: planning and finding its units run its forward.

Planning (:func:`pipepar.profile`, the layout search of ``pipepar.wrap(sample=...)``, the FLOP
count, the ``pipe_split()`` markers) and :func:`pipepar.units` run the model's own forward on
the sample. That run must change nothing a later step sees, and a forward changes more than
its buffers' values:

- a training-mode batch norm moves its running statistics and counts a batch;
- a dropout advances the random generators;
- a forward stores what it learned on its module: a counter (``self.calls += 1``), a cache
  filled on the first call, a length it grew for; transformers' dynamic rotary embedding
  records ``max_seq_len_cached`` and registers a new ``inv_freq`` tensor (a new object:
  copying the old values into the old buffer would leave the new one registered);
- it may register buffers, submodules or hooks.

:func:`untouched` therefore snapshots, for every module of the tree, its ``__dict__`` shallowly
(which object each attribute names), the contents of the containers it holds one or two
levels deep (``_parameters``, ``_buffers``, ``_modules``, the hook dictionaries, a list or
dict of the module's own), and puts all of that back afterwards: attributes the forward added
are deleted, rebound ones point at their old objects again, containers hold their old
entries (in place, so hook handles stay valid): a hook or submodule the forward added is gone,
one it removed is back. Nothing is keyed on a class or a name.

Why put back rather than plan on a copy: a copy of a model on a device costs its weights'
memory again, exactly where a large model has none to spare, and ``copy.deepcopy`` fails on
some models (open files, process groups); a snapshot costs the buffers (a meta model's:
nothing but the walk over its modules' attributes).

What is copied and what is only referenced (the cost of a look stays the size of the buffers,
never the size of the weights):

- buffers and tensors held as plain attributes (in containers too) are cloned, unless on
  ``meta``: a forward may write into them in place (``running_mean``, a counter tensor's
  ``+=``), and each clone is copied back, changed or not: a tensor's version counter cannot
  tell (batch norm's kernel updates its running statistics without moving it);
- parameters and their ``.grad`` are referenced, never copied (that would double the model's
  memory): planning runs on stand-ins, and a forward that writes a weight or gradient in place
  through an operation that moves its version counter (``mul_``, ``+=``, ``copy_`` on the
  parameter itself) raises :class:`ValueError` (the weights then differ from the model the
  user passed, and no copy exists to put back); a write through ``.data`` moves no counter
  and is not seen. A tensor on a weight's storage (``self.w_t = self.weight.detach().t()``)
  counts as the weight's: referenced, not copied;
- any other object (a config, a tokenizer) is referenced: its identity is restored, its own
  attributes are not looked into;
- a lazy module not yet initialized is refused: its first forward creates its parameters in
  place, which could not be undone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ModuleState", "untouched"]

_DEPTH = 2  # how deep containers' contents are followed: a list of tensors, a dict of lists


@contextmanager
def untouched(model: nn.Module) -> Iterator[ModuleState]:
    """Run the block, then put back the random generators' states (the CPU's and every
    initialized CUDA device's) and every module of ``model`` as it was: its attributes, its
    registered buffers, parameters, submodules and hooks (same objects), buffers' values.

    The block gets the :class:`ModuleState`: a block that runs the forward several times (a
    profile: once to trace, once on ``meta``, once to time) calls its ``restore()`` before
    each, so that no run starts from what the one before it stored (a cache filled on the CPU
    and read on ``meta``).

    Raises:
        ValueError: the block wrote a parameter or a gradient in place (after the rest was put
            back; only when the block itself raised nothing).

    Example:
        >>> bn = nn.BatchNorm1d(3)
        >>> with untouched(bn):
        ...     _ = bn(torch.randn(4, 3))
        >>> int(bn.num_batches_tracked)
        0
    """
    state = ModuleState(model)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield state
        finally:
            written = state.written()  # before restore(), whose copies may write a weight's view
            state.restore()
    if written:
        raise ValueError(
            f"planning ran the model's forward, which wrote {', '.join(written)} in place; "
            "pipepar keeps no copy of the weights to put back, so the pipe would start from "
            "other weights than the model you passed; give the layout instead of a sample: "
            "balance=[units per stage] or split=[module paths where stages begin] "
            "(pipepar.units(model) lists the units)"
        )


class ModuleState:
    """What every module of a tree holds, taken at construction; :meth:`restore` puts it back.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> state = ModuleState(layer)
        >>> layer.calls = 1
        >>> state.restore()
        >>> hasattr(layer, "calls")
        False
    """

    def __init__(self, model: nn.Module) -> None:
        _refuse_lazy(model)
        self._values: dict[int, tuple[Tensor, Tensor]] = {}
        self._weights: dict[int, tuple[str, Tensor, int]] = {}
        self._empty: list[Any] = []  # containers that held nothing (most hook dictionaries)
        self._filled: list[tuple[Any, Any]] = []  # a container and a copy of its entries
        self._grads: list[tuple[Tensor, Tensor | None]] = []
        self._dicts: list[tuple[nn.Module, type, dict[str, Any]]] = []
        # A tensor on a weight's storage (a transposed view, a detached alias) is the weight's.
        self._weight_storages = {_storage(p) for p in model.parameters() if not p.is_meta} - {0}
        for path, module in model.named_modules():
            self._dicts.append((module, type(module), dict(module.__dict__)))
            for key, value in module.__dict__.items():
                if key == "_parameters":
                    self._take_parameters(path, value)
                self._take(value, _DEPTH)

    def restore(self) -> None:
        """Every module's attributes, containers and tensor values as they were taken."""
        for module, cls, saved in self._dicts:
            if type(module) is not cls:
                module.__class__ = cls
            current = module.__dict__
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        for container in self._empty:
            if container:
                container.clear()
        for container, entries in self._filled:
            _refill(container, entries)
        for p, grad in self._grads:
            if p.grad is not grad:
                p.grad = grad
        with torch.no_grad():
            for tensor, copy in self._values.values():
                _put_back(tensor, copy)

    def written(self) -> list[str]:
        """The parameters and gradients written in place since the state was taken (by an
        operation that moves the version counter)."""
        return [name for name, t, version in self._weights.values() if t._version != version]

    def _take_parameters(self, path: str, params: dict[str, Any]) -> None:
        prefix = f"{path}." if path else ""
        for name, p in params.items():
            if not isinstance(p, Tensor):
                continue
            self._grads.append((p, p.grad))
            for what, t in (
                (f"parameter {prefix}{name}", p),
                (f"the gradient of {prefix}{name}", p.grad),
            ):
                if t is not None and not t.is_meta and not t.is_inference():
                    self._weights.setdefault(id(t), (what, t, t._version))

    def _take(self, value: Any, depth: int) -> None:
        """Remember what ``value`` holds that a forward may change in place."""
        if isinstance(value, Tensor):
            if not isinstance(value, nn.Parameter):  # weights: by reference (above)
                self._take_tensor(value)
            return
        if type(value) not in _CONTAINERS:
            return  # a module (walked itself), any other object: by reference in the __dict__
        if isinstance(value, tuple):
            self._take_items(value, depth)
        elif not value:
            self._empty.append(value)
        elif isinstance(value, dict):
            items = list(value.items())
            self._filled.append((value, items))
            self._take_items((v for _, v in items), depth)
        else:
            entries = list(value) if isinstance(value, list) else set(value)
            self._filled.append((value, entries))
            self._take_items(entries, depth)

    def _take_items(self, items: Any, depth: int) -> None:
        if depth > 0:
            for item in items:
                self._take(item, depth - 1)

    def _take_tensor(self, t: Tensor) -> None:
        if t.is_meta or id(t) in self._values:
            return
        if _storage(t) in self._weight_storages:
            return
        self._values[id(t)] = (t, t.detach().clone())


_MISSING = object()
# Plain containers only: a subclass (a model output, a config) may refuse clear() or update().
_CONTAINERS = (dict, OrderedDict, list, set, tuple)


def _refuse_lazy(model: nn.Module) -> None:
    """A lazy module's first forward creates its parameters in place (and changes its class):
    nothing to put back, and the pipe would hold weights drawn at another moment than the
    plain model's first call draws them."""
    lazy = [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if nn.parameter.is_lazy(t)
    ]
    if lazy:
        raise ValueError(
            f"model has uninitialized (lazy) parameters or buffers: {', '.join(lazy[:4])}"
            f"{' ...' if len(lazy) > 4 else ''}; planning runs the forward, which would "
            "create them, and could not leave the model as you passed it; call the model once "
            "on a batch (model(sample)) before wrapping or planning, as torch asks before "
            "building an optimizer"
        )


def _storage(t: Tensor) -> int:
    """Where ``t``'s storage starts; 0 for a tensor without one (sparse, a wrapper subclass)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _put_back(tensor: Tensor, copy: Tensor) -> None:
    if tensor.is_inference():
        with torch.inference_mode():
            tensor.copy_(copy)
    else:
        tensor.copy_(copy)


def _refill(target: Any, entries: Any) -> None:
    """``target`` (a dict, list or set) holding ``entries`` again, the same objects in the same
    order; untouched when it still does."""
    if isinstance(target, dict):
        same = len(target) == len(entries) and all(
            a == k and target[a] is v for a, (k, v) in zip(target, entries)
        )
        if not same:
            target.clear()
            target.update(entries)
    elif isinstance(target, list):
        if len(target) != len(entries) or any(a is not b for a, b in zip(target, entries)):
            target[:] = entries
    elif target != entries:
        target.clear()
        target.update(entries)
