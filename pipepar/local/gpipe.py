"""GPipe: torchgpipe's interface on a pipepar :class:`~pipepar.local.pipe.Pipe`.

Code written for ``torchgpipe.GPipe`` (or for fairscale's Pipe, or the Pipe once in
``torch.distributed.pipeline.sync``) runs on pipepar by changing the import: the constructor
takes the same arguments, the pipe has the same attributes, and each mistake raises the
exception type torchgpipe raises for it, with pipepar's message. On purpose, the state_dict
keys stay the plain model's (torchgpipe adds ``partitions.<j>.``).

This module only translates arguments and errors; running is the Pipe's job.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.devices import to_device
from pipepar.core.microbatch import Value, check_value
from pipepar.local.pipe import Pipe

__all__ = ["DeviceError", "GPipe"]

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
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` recompute in backward.
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
        )

    def _init_identity(self, chunks: int, checkpoint: str) -> None:
        # A Pipe needs a layer: build one over a placeholder, then drop it (no stage, no child).
        super().__init__(
            nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=chunks, checkpoint=checkpoint
        )
        delattr(self, "0")
        self._stages = []

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
