"""The meta device as a real run sees it: known small values, and attention as fused kernels run it.

On ``meta`` a tensor has a shape and a dtype but no value, so a model can be run there (to
trace its memory, or to follow the stages another rank computes) without memory or
arithmetic. Two things a model does then go another way than on a real device, and this
module makes them agree with one:

- data-dependent reads (``tensor.item()``, ``bool(mask.all())``): :class:`MetaScalars` keeps a
  small CPU copy of every tensor whose value is known (token ids, masks, positions made by
  ``arange``, constants: at most :data:`SHADOW_LIMIT` elements), replays each operation on the
  copies, and answers a read from them, so the model takes the path a real run takes;
- attention: :class:`FusedGroupedAttention` routes ``scaled_dot_product_attention`` (grouped-
  query attention and ``nn.MultiheadAttention`` included) to the fused kernel's meta function,
  which keeps what that kernel keeps rather than the ``T x T`` probabilities of the unfused
  path.

:func:`meta_modes` enters both for a pass on meta. The profile of any model
(:mod:`pipepar.planner.model_profile`) traces under them, and the shadow stages of a rank
(:mod:`pipepar.program.ranks`) follow the others' code under :class:`MetaScalars`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipepar.meta.attention import _fusable, _fused
from pipepar.meta.fallback import without_meta_kernel
from pipepar.meta.shapes import MetaShapes

__all__ = [
    "SHADOW_LIMIT",
    "FusedGroupedAttention",
    "KnownValues",
    "MetaScalars",
    "forget_dead",
    "meta_modes",
]

_aten = torch.ops.aten
_CPU = torch.device("cpu")
SHADOW_LIMIT = 1 << 22
"""Largest tensor (elements) whose value :class:`MetaScalars` follows on the CPU."""


KnownValues = dict[int, tuple["weakref.ref[Tensor]", Tensor]]
"""The known values of meta tensors, by ``id``, each beside a reference to its tensor."""


def forget_dead(known: KnownValues) -> None:
    """Drop the values of meta tensors that no longer exist."""
    for key in [k for k, (ref, _) in known.items() if ref() is None]:
        known.pop(key, None)


class _Unknown(Exception):
    """A meta tensor whose value is not known."""


def _tensors(out: Any) -> list[Tensor]:
    """The tensors an aten operation returned: one, or a tuple or list of them."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, Tensor)]
    return []


class MetaScalars(TorchDispatchMode):
    """Give meta tensors whose value is known a small CPU twin, so models can read it.

    Meta tensors have shapes but no values, so ``bool(mask.all())`` or ``tensor.item()`` fails
    on them, and transformers makes such checks before building an attention mask ("is the
    mask all ones?", "are sequences packed?"). It skips them while tracing (FakeTensor,
    dynamo), but then takes the path that materializes a ``B x 1 x T x T`` mask and runs
    unfused attention: not what a real run does, so a trace would count memory no device
    holds. Instead, this mode runs every operation whose tensor inputs all have a known value
    (the sample's token ids and masks, positions made by ``arange``, constants) a second time
    on CPU copies of at most :data:`SHADOW_LIMIT` elements, and a data-dependent read of a meta
    tensor is answered from its copy: exactly what the real run would read. A sample given on
    meta (no values) stands for a batch of ones (every token id 1, every mask set: no padding).
    Model weights and activations have no copy; a read of one raises, naming a fix.

    Must be entered below a :class:`~pipepar.planner.memory_tracker.MemoryTracker` (before
    it), which then does not see the copies.

    Example:
        >>> ids = torch.empty(2, 8, dtype=torch.long, device="meta")
        >>> with MetaScalars() as values:
        ...     values.know(ids, torch.ones(2, 8, dtype=torch.long))
        ...     bool((ids == 1).all())
        True
    """

    def __init__(self, shapes: MetaShapes | None = None, known: KnownValues | None = None) -> None:
        super().__init__()
        self._values: KnownValues = known if known is not None else {}
        """The values known, by the meta tensor's ``id``: shared by the modes of every
        micro-batch of a rank given the same ``known``, so that a meta value a module keeps
        (a dynamic rotary embedding's longest length) is known to the next micro-batch that
        reads it, as it is to a real run."""
        self._shapes = shapes
        """Where the outputs of operations seen before are made without their meta kernels
        (None: every operation runs)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing compiles inside this mode: its handler is not wrapped to skip the compiler
        # (a few microseconds per operation).
        return False

    def know(self, meta: Tensor, value: Tensor) -> None:
        """Tell the mode the value of ``meta`` (a CPU tensor of its shape and dtype)."""
        # No callback to forget it: one closing over the mode would make a cycle that keeps
        # the values until the cycle collector runs; a stale entry is told by its dead ref.
        self._values[id(meta)] = (weakref.ref(meta), value)

    def value(self, meta: Tensor) -> Tensor | None:
        """The known value of ``meta``, or None."""
        found = self._values.get(id(meta))
        return found[1] if found is not None and found[0]() is meta else None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].is_meta:
            return self._read(args[0])
        out = self._run(func, args, kwargs)
        metas = [t for t in _tensors(out) if t.is_meta]
        if metas:
            self._follow(func, args, kwargs, metas)
        return out

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func``'s outputs: made from the shapes it gave before on inputs of these shapes,
        or computed (and their shapes kept)."""
        shapes = self._shapes
        if shapes is None or (key := shapes.key(func, args, kwargs)) is None:
            return self._computed(func, args, kwargs)[0]
        out = shapes.made(key)
        if out is None:
            out, kernel = self._computed(func, args, kwargs)
            if kernel:  # outputs made from values are not those of every input of the shape
                shapes.remember(key, out)
        return out

    def _computed(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, bool]:
        """``func``'s outputs, and whether its meta kernel made them; where it cannot, they
        are made from the inputs' known values or another dtype
        (:mod:`pipepar.meta.fallback`)."""
        try:
            return func(*args, **kwargs), True
        except Exception as error:
            return without_meta_kernel(func, args, kwargs, self._all_on_cpu, error), False

    def _all_on_cpu(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._on_cpu(v) for k, v in value.items()}
        return self._on_cpu(value)

    def _follow(self, func: Any, args: Any, kwargs: Any, metas: list[Tensor]) -> None:
        """Run ``func`` on the inputs' values; forget the outputs' values if it cannot (an
        in-place operation with an unknown input makes its output's value unknown)."""
        values = None
        if all(t.numel() <= SHADOW_LIMIT for t in metas):
            values = self._replay(func, args, kwargs)
        if values is None or len(values) != len(metas):
            for t in metas:
                self._values.pop(id(t), None)
            return
        for meta, value in zip(metas, values):
            self.know(meta, value)

    def _replay(self, func: Any, args: Any, kwargs: Any) -> list[Tensor] | None:
        try:
            a = [self._on_cpu(v) for v in args]
            k = {name: self._on_cpu(v) for name, v in kwargs.items()}
        except _Unknown:
            return None
        try:
            out = func(*a, **k)
        except Exception:  # an operation the CPU copy cannot take: the value stays unknown
            return None
        return _tensors(out)

    def _on_cpu(self, value: Any) -> Any:
        """An operation's argument with each meta tensor replaced by its known value (raises
        :class:`_Unknown` when one has none) and the meta device by the CPU."""
        if isinstance(value, Tensor):
            if not value.is_meta:
                return value
            known = self.value(value)
            if known is None:
                raise _Unknown
            return known
        if type(value) in (list, tuple):
            return type(value)(self._on_cpu(v) for v in value)
        if isinstance(value, torch.device) and value.type == "meta":
            return _CPU
        return value

    def _read(self, tensor: Tensor) -> Any:
        value = self.value(tensor)
        if value is not None:
            return value.item()
        raise ValueError(
            f"the model reads the value of a {tensor.dtype} meta tensor of shape "
            f"{tuple(tensor.shape)} (Tensor.item() or bool()) that depends on weights or "
            "activations, which the meta device does not have; profile on a real device with "
            "a small batch (device='cpu'), or make the model skip the check"
        )


class FusedGroupedAttention(TorchFunctionMode):
    """:class:`~pipepar.meta.attention.FusedAttention` (whose routing it reuses), and
    grouped-query attention too: transformers calls ``scaled_dot_product_attention`` with
    ``enable_gqa=True`` for Llama when there is no mask, and the fused kernels (flash
    attention on CPU and CUDA) then keep keys and values with their own, fewer heads; torch's
    meta path would repeat them and keep the ``T x T`` probabilities of every query head.

    Also inside ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``: torchvision's
    ViT): a torch function runs with the modes off, so the attention it calls would not pass
    here; for the length of that call ``F.scaled_dot_product_attention`` is the routing
    function (meta tensors only; anything else goes to torch's own)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _attention(func, args, kwargs)
        if func is F.multi_head_attention_forward:
            return _routed_inside(func, args, kwargs)
        return func(*args, **kwargs)


def _attention(original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention on meta as the fused kernel runs it, where it would; else torch's own."""
    if _grouped(*args, **kwargs):
        return _fused_grouped(*args, **kwargs)
    if _fusable(*args, **kwargs):
        return _fused(*args, **kwargs)
    return original(*args, **kwargs)


def _routed_inside(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    original = F.scaled_dot_product_attention

    def attention(*a: Any, **k: Any) -> Any:
        return _attention(original, a, k)

    setattr(F, "scaled_dot_product_attention", attention)  # noqa: B010
    try:
        return func(*args, **kwargs)
    finally:
        setattr(F, "scaled_dot_product_attention", original)  # noqa: B010


def _grouped(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    *args: Any,
    enable_gqa: bool = False,
    **kwargs: Any,
) -> bool:
    if not (enable_gqa and query.is_meta and attn_mask is None and query.dim() == 4):
        return False
    return key.shape[1] == value.shape[1] and query.shape[1] % key.shape[1] == 0


def _fused_grouped(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    op = _aten._scaled_dot_product_flash_attention_for_cpu
    return op(query, key, value, dropout_p, is_causal, scale=scale)[0]  # type: ignore[no-any-return]


def meta_modes(
    device: torch.device, known: Iterable[tuple[Tensor, Tensor]] = ()
) -> contextlib.AbstractContextManager[Any]:
    """What a pass on ``device`` runs under, entered before any memory tracker: on meta,
    :class:`MetaScalars` knowing the values ``known`` gives (``(meta tensor, CPU value)``
    pairs: a sample's token ids and masks), and fused attention; elsewhere, nothing."""
    if device.type != "meta":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    values = stack.enter_context(MetaScalars())
    for meta, value in known:
        values.know(meta, value)
    stack.enter_context(FusedGroupedAttention())
    return stack
