"""GPipe: torchgpipe's interface on a pipepar :class:`~pipepar.pipe.Pipe`.

Code written for ``torchgpipe.GPipe`` (or for fairscale's Pipe, or the Pipe once in
``torch.distributed.pipeline.sync``) runs on pipepar by changing the import: the constructor
takes the same arguments, the pipe has the same attributes, and each mistake raises the
exception type torchgpipe raises for it, with pipepar's message. On purpose, the state_dict
keys stay the plain model's (torchgpipe adds ``partitions.<j>.``); a torchgpipe checkpoint loads
all the same, and :func:`from_torchgpipe_state_dict` converts one for the plain model.

This module only translates arguments and errors; running is the Pipe's job.
"""

from __future__ import annotations

import numbers
import re
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.devices import to_device
from pipepar.core.microbatch import Value, check_value
from pipepar.pipe import Pipe

__all__ = ["DeviceError", "GPipe", "from_torchgpipe_state_dict"]

Devices = Iterable[str | int | torch.device] | int | None


class DeviceError(ValueError, RuntimeError):
    """A device that torch does not know, or that this machine lacks.

    A ValueError like pipepar's other argument errors, and a RuntimeError like the one torch
    (and so torchgpipe) raises for the same mistake, so ``except RuntimeError`` still works.
    """


class GPipe(Pipe):
    """A drop-in for ``torchgpipe.GPipe``: the same arguments, attributes and exception types.

    Args:
        module: the ``nn.Sequential`` to split (an empty one is the identity).
        balance: layers per partition, e.g. ``[2, 2]`` (any iterable of whole numbers).
        devices: one device per partition; ``None`` = every CUDA device, or the CPU for every
            partition on a machine without CUDA (where torchgpipe would find no device).
        chunks: micro-batches per mini-batch; a whole float such as ``8.0`` is taken as ``8``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` recompute in backward (or,
            as in torchgpipe, any object whose ``str()`` is one; ``pipe.checkpoint`` is the str).
        deferred_batch_norm: track batch-norm statistics over the whole mini-batch.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; or ``to(device)``, ``cuda()`` or
            ``cpu()`` is called on the pipe.
        ValueError: a wrong ``balance``, ``chunks`` or ``checkpoint``.
        IndexError: fewer devices than partitions.
        DeviceError: a device name torch does not know, or CUDA where there is none.

    Example:
        >>> from pipepar import GPipe  # was: from torchgpipe import GPipe
        >>> model = GPipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cpu", "cpu"],
        ...               chunks=8)
        >>> output = model(input.to(model.devices[0]))
        >>> model.load_state_dict(torch.load("saved_by_torchgpipe.pt"))  # its keys work too
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Devices = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        chunks = _check_chunks(chunks)
        checkpoint = validation.check_checkpoint(checkpoint)
        module = _check_model(module)
        sizes = _check_balance(balance, len(module))
        placed = _check_devices(devices, len(sizes))
        if not sizes:
            self._init_identity(chunks, checkpoint)
            return
        super().__init__(
            module,
            sizes,
            devices=placed,
            chunks=chunks,
            checkpoint=checkpoint,
            deferred_batch_norm=deferred_batch_norm,
            batch_coupling="per-micro-batch",  # torchgpipe's: batch norm per micro-batch
        )

    def _init_identity(self, chunks: int, checkpoint: str) -> None:
        # A Pipe needs a layer: build one over a placeholder, then drop it (no stage, no child).
        super().__init__(
            nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=chunks, checkpoint=checkpoint
        )
        delattr(self, "0")
        self._view.stages = []

    def forward(self, input: Value) -> Value:
        """Run the batch through the partitions; an empty model returns ``input`` itself."""
        if len(self) == 0:
            return check_value(input, what="input")
        return super().forward(input)

    # torchgpipe refuses to move a GPipe with TypeError; to(dtype) is allowed.
    def to(self, *args: Any, **kwargs: Any) -> GPipe:  # type: ignore[override]
        if torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            raise _moving_denied("to(device)")
        return super().to(*args, **kwargs)  # type: ignore[return-value]

    def cuda(self, device: Any = None) -> GPipe:  # type: ignore[override]
        raise _moving_denied("cuda()")

    def cpu(self) -> GPipe:  # type: ignore[override]
        raise _moving_denied("cpu()")

    # -- torchgpipe's checkpoints: partitions.<j>.<name>... is the model's <name>... ------------
    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the plain model's state_dict, or torchgpipe's (``partitions.<j>.`` keys)."""
        if isinstance(state_dict, Mapping) and self._torchgpipe_keys(state_dict, ""):
            state_dict = _plain(state_dict, self._modules)
        return super().load_state_dict(state_dict, strict, assign)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Where the pipe is a child of the module loading (its keys under ``prefix``).
        if self._torchgpipe_keys(state_dict, prefix):
            converted = _converted(state_dict, prefix, self._modules)
            state_dict.clear()
            state_dict.update(converted)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _torchgpipe_keys(self, state_dict: Mapping[str, Any], prefix: str) -> bool:
        # A layer of the model may itself be called "partitions": its keys are the model's.
        return "partitions" not in self._modules and bool(_renames(state_dict, prefix, None))


_TORCHGPIPE_KEY = re.compile(r"partitions\.\d+\.")
_ACCUMULATORS = ("sum", "sum_squares")  # of torchgpipe's DeferredBatchNorm
_STATISTICS = ("running_mean", "running_var")


def from_torchgpipe_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A ``torchgpipe.GPipe`` state_dict with the plain model's keys.

    torchgpipe keeps the model's layer names inside its partitions and adds the partition:
    layer ``3`` of partition 1 saves ``partitions.1.3.weight``, the plain model's ``3.weight``.
    The result loads into the plain ``nn.Sequential``, a :class:`GPipe` or any pipepar pipe of
    it, whatever their balance. The accumulators of torchgpipe's deferred batch norm (``sum``
    and ``sum_squares``, zero between mini-batches) are left out: pipepar's keeps none. Other
    keys, and the ``_metadata`` torch keeps with the tensors, are kept under the new names.

    Args:
        state_dict: what ``torchgpipe.GPipe.state_dict()`` returned (or a file of it).

    Returns:
        A new state dict under the plain model's keys, the tensors themselves (not copies).

    Raises:
        ValueError: a key and torchgpipe's key of the same tensor are both there.

    Example:
        >>> state = from_torchgpipe_state_dict(torch.load("saved_by_torchgpipe.pt"))
        >>> plain_model.load_state_dict(state)  # 'partitions.1.3.weight' is now '3.weight'
    """
    return _plain(state_dict, None)


def _plain(state_dict: Mapping[str, Any], layers: Container[str] | None) -> OrderedDict[str, Any]:
    """The keys and metadata converted, for the layers named in ``layers`` (None: all)."""
    converted = _converted(state_dict, "", layers)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        converted._metadata = _converted_metadata(metadata)  # type: ignore[attr-defined]
    return converted


def _renames(keys: Iterable[str], prefix: str, layers: Container[str] | None) -> dict[str, str]:
    """torchgpipe's keys under ``prefix``, each with the plain model's key: those of a layer
    in ``layers`` (None: of any), so that a key of no layer is reported as it was given."""
    renames = {}
    for key in keys:
        match = _TORCHGPIPE_KEY.match(key, len(prefix)) if key.startswith(prefix) else None
        if match is None:
            continue
        plain = key[match.end() :]
        if layers is None or plain.split(".", 1)[0] in layers:
            renames[key] = prefix + plain
    return renames


def _converted(
    state_dict: Mapping[str, Any], prefix: str, layers: Container[str] | None
) -> OrderedDict[str, Any]:
    """``state_dict`` with torchgpipe's keys under ``prefix`` renamed, in the same order."""
    renames = _renames(state_dict, prefix, layers)
    for old, new in renames.items():
        if new in state_dict:
            raise ValueError(
                f"state_dict has both {new!r} and torchgpipe's key of the same tensor, {old!r}; "
                "keep only one of them (the state_dict of one model)"
            )
    dropped = _accumulators(list(renames.values()))
    converted: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        new = renames.get(key, key)
        if new not in dropped:
            converted[new] = value
    return converted


def _accumulators(keys: Sequence[str]) -> set[str]:
    """The ``sum`` and ``sum_squares`` buffers of each batch norm among ``keys`` that has them
    next to its running statistics: torchgpipe's DeferredBatchNorm."""
    present = set(keys)
    dropped: set[str] = set()
    for key in keys:
        if not key.endswith(".sum_squares"):
            continue
        base = key[: -len("sum_squares")]
        if all(base + name in present for name in _ACCUMULATORS + _STATISTICS):
            dropped.update(base + name for name in _ACCUMULATORS)
    return dropped


def _converted_metadata(metadata: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """torch's per-module metadata (versions) under the plain model's module names; the
    partitions themselves, modules the plain model lacks, are left out."""
    converted: OrderedDict[str, Any] = OrderedDict()
    for name, value in metadata.items():
        match = _TORCHGPIPE_KEY.match(name + ".")
        if match is not None and match.end() <= len(name):
            converted[name[match.end() :]] = value
        elif name.split(".", 1)[0] != "partitions":
            converted[name] = value
    return converted


def _moving_denied(call: str) -> TypeError:
    return TypeError(
        f"GPipe.{call} would move every partition to one device; GPipe places each partition "
        "on its device itself. Move the model before wrapping it, or pass devices=[...] to "
        "GPipe (to(dtype) is allowed)"
    )


def _whole(value: object, name: str) -> object:
    """A whole float as an int; a fractional one is an error; anything else as it is."""
    if not isinstance(value, numbers.Real) or isinstance(value, numbers.Integral):
        return value
    number = float(value)
    if not number.is_integer():
        raise ValueError(
            f"{name} must be a whole number, but got {value!r}; pass e.g. {name}={round(number)}"
        )
    return int(number)


def _check_chunks(chunks: object) -> int:
    if isinstance(chunks, str):  # torchgpipe's int(chunks) raises ValueError on these
        raise ValueError(f"chunks must be a number, but got the string {chunks!r}; e.g. chunks=8")
    return validation.check_chunks(_whole(chunks, "chunks"))


def _check_model(module: object) -> nn.Sequential:
    if isinstance(module, nn.Sequential) and len(module) == 0:
        return module  # as in torchgpipe: no partitions, the pipe is the identity
    return validation.check_model(module)


def _check_balance(balance: object, n_layers: int) -> list[int]:
    if balance is None:
        raise ValueError(
            f"balance is None, but GPipe needs the layers per partition (the model has "
            f"{n_layers}); pass e.g. balance=[{n_layers}], or let pipepar plan it with "
            "pipepar.wrap(model, sample=batch, devices=...)"
        )
    if isinstance(balance, Iterable) and not isinstance(balance, (str, bytes)):
        balance = [_whole(b, f"balance[{j}]") for j, b in enumerate(balance)]
    if n_layers == 0 and balance == []:
        return []
    return validation.check_balance(balance, n_layers)


def _check_devices(devices: object, n_stages: int) -> list[torch.device] | int | None:
    """pipepar's devices (``None`` and an int as in :func:`pipepar.wrap`), with torchgpipe's
    exception types: IndexError for too few, DeviceError where torch raises RuntimeError."""
    if devices is None and not torch.cuda.is_available():
        return None  # the CPU for every stage
    if devices is None:
        devices = range(torch.cuda.device_count())
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        _check_count(int(devices), n_stages, [])
        return int(devices)
    if isinstance(devices, str):
        raise DeviceError(
            f"devices must be a list of devices, but got the string {devices!r}; pass one per "
            f"partition, e.g. devices={[devices] * max(n_stages, 1)}"
        )
    if not isinstance(devices, Iterable):
        raise TypeError(
            f"devices must be a list of devices, but got {devices!r}; pass one per partition, "
            "e.g. devices=['cuda:0', 'cuda:1'] or devices=['cpu', 'cpu']"
        )
    resolved = [_device(d) for d in devices]
    _check_count(len(resolved), n_stages, resolved)
    return resolved


def _device(spec: object) -> torch.device:
    try:
        return to_device(spec)  # type: ignore[arg-type]
    except ValueError as error:
        # torch.device raises RuntimeError for a name or index it refuses, TypeError otherwise.
        known = isinstance(spec, (str, int, torch.device))
        raise (DeviceError if known else TypeError)(str(error)) from None


def _check_count(count: int, n_stages: int, devices: Sequence[torch.device]) -> None:
    if count < n_stages:
        given = f" ({[str(d) for d in devices]})" if devices else ""
        raise IndexError(
            f"balance has {n_stages} partitions but devices has {count}{given}; pass one "
            "device per partition (repeat 'cpu' to run several on the CPU) or use fewer"
        )
