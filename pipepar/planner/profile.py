"""Per-layer memory and time of an ``nn.Sequential``, measured on a real device or on ``meta``.

The profile describes one training step on the WHOLE sample batch. The planner scales the
batch-dependent figures (activations, outputs, transients) to one micro-batch: a batch of ``B``
rows split into ``M`` chunks has micro-batches of ``ceil(B / M)`` rows, so those figures are
multiplied by ``ceil(B / M) / B``.

On ``meta`` nothing is allocated, so a model no machine here could hold can still be planned;
the figures agree with a CPU run of the same model (see ``tests/planner/test_profile.py``).
Times are only measured on real devices.

    >>> prof = pipepar.profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8))
    >>> prof.layers[0].params_bytes
    288
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from pipepar.core import validation
from pipepar.core.untouched import untouched
from pipepar.planner.deferred_grads import deferred_grads
from pipepar.planner.layer_trace import StorageRecord, stand_ins, time_layers, trace_layers
from pipepar.planner.memory_tracker import storage_key
from pipepar.planner.optimizer_state import OptimizerSpec, optimizer_cost, resolve_optimizer

__all__ = ["LayerProfile", "Profile", "check_device", "profile", "training_step", "usable"]

logger = logging.getLogger(__name__)

Shape = tuple[Any, ...]
ParamSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs for one training step on the whole sample batch.

    Attributes:
        index: position in the ``nn.Sequential``.
        name: the child's name in the ``nn.Sequential`` (``"0"``, ``"conv1"``, ...).
        type_name: the layer's class name.
        output_shape: shape of the output tensor, or a tuple of shapes for tuple outputs.
        params_bytes: bytes of parameters (a parameter shared with an earlier layer counts there).
        grads_bytes: bytes of gradients (parameters that require grad).
        optimizer_bytes: bytes of optimizer state kept between steps.
        activation_bytes: bytes autograd keeps for backward, each storage counted once, at the
            layer that created it (a ReLU output that the next Linear saves counts at the ReLU).
        output_bytes: bytes of the output handed to the next layer.
        forward_peak_bytes: temporaries of the forward beyond what the layer keeps and returns.
        backward_peak_bytes: temporaries of the backward beyond parameter gradients, the
            incoming gradient included.
        backward_inner_bytes: the same when the incoming gradient comes from the next layer of
            the stage and can be freed midway (differs after in-place layers).
        optimizer_step_bytes: temporaries of the optimizer step, per-tensor implementation.
        optimizer_step_foreach_bytes: the same for the multi-tensor (``foreach``) one.
        forward_ms: forward time on the profiling device; None on ``meta``.
        backward_ms: backward time on the profiling device; None on ``meta``.
        forward_call_ms: the part of ``forward_ms`` a call costs whatever its rows (launches,
            the framework's own work, kernels too small to fill the device): a call on ``r``
            of the batch's rows takes ``forward_call_ms + r * (forward_ms -
            forward_call_ms)``. 0 (time proportional to rows) unless fitted from a second
            profile on fewer rows (:func:`pipepar.planner.call_times.with_call_times`).
        backward_call_ms: the same for ``backward_ms`` (a weight gradient is written whole
            whatever the rows).
        modifies_input: whether the layer writes into its input (``ReLU(inplace=True)``); a
            stage cannot start with such a layer, since its input is a leaf that needs grad.
        reuses_grad: whether its backward hands on the incoming gradient's memory (views,
            in-place layers) rather than a new gradient.
        backward_points: the backward's peak (incoming gradient and parameter gradients
            included) as pairs (other bytes, gradient bytes) seen as it ran: at ``r`` times the
            batch it peaks at ``max(r * other + gradients)``. A backward frees the layer's
            activations while it makes the gradients, and only the former shrink with the
            micro-batch, so ``r * (backward_peak_bytes + grads_bytes)`` is wrong both ways.
        retained_points: the same for a backward that keeps the graph (nothing the forward
            saved is freed), as W runs the first stage's whole backward under zero-bubble
            schedules.
        deferred_grad_bytes: gradients a split backward (zero-bubble B) keeps until W, on top
            of the graph (see :mod:`pipepar.planner.deferred_grads`).
        keeps_incoming_grad: whether those include the gradient that came into the layer.
        splits_backward: False when the backward cannot be split (a parameter reached along
            two paths); a stage with such a layer runs its whole backward in B.
        generic_params: how many parameters W computes with autograd again; a stage with any
            keeps its graph from B to W (unknown: 1).
        direct_grad_bytes: gradients of parameters a split W sums in place once their sum
            exists (matrix products, no temporary).
        direct_saved_bytes: the saved inputs of those products, which a micro-batch keeps for
            W when B does not keep the graph; ``direct_saved_input_bytes`` of them the layer's
            input.
        whole_direct_grad_bytes: ``direct_grad_bytes`` of an unsplit backward.
        largest_matrix: elements of the layer's largest weight matrix; with ``2**17`` or more
            a stage's unsplit backward takes that direct route too.
        split_input_peak_bytes: the most bytes B of a split backward of the layer holds
            beyond what was alive before its incoming gradient (which it includes): what
            W reads and the gradients B records stay, the rest of what the forward saved is
            freed as B goes; 0 where not measured.

    Example:
        >>> prof = pipepar.profile(zoo.mlp(depth=2, width=16), torch.randn(8, 16))
        >>> layer = prof.layers[0]
        >>> layer.name, layer.params_bytes  # 16 x 16 weights and 16 biases, float32
        ('0', 1088)
    """

    index: int
    name: str
    type_name: str
    output_shape: Shape
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    output_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    backward_inner_bytes: int = 0
    optimizer_step_bytes: int = 0
    optimizer_step_foreach_bytes: int = 0
    forward_ms: float | None = None
    backward_ms: float | None = None
    forward_call_ms: float = 0.0
    backward_call_ms: float = 0.0
    modifies_input: bool = False
    reuses_grad: bool = False
    backward_points: tuple[tuple[int, int], ...] = ()
    retained_points: tuple[tuple[int, int], ...] = ()
    deferred_grad_bytes: int = 0
    keeps_incoming_grad: bool = False
    splits_backward: bool = True
    generic_params: int = 1
    direct_grad_bytes: int = 0
    direct_saved_bytes: int = 0
    direct_saved_input_bytes: int = 0
    whole_direct_grad_bytes: int = 0
    largest_matrix: int = 0
    split_input_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The layer's transient peak: the larger of its forward and backward temporaries."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def time_ms(self) -> float | None:
        """Forward plus backward time, or None when not measured."""
        if self.forward_ms is None or self.backward_ms is None:
            return None
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class Profile:
    """The result of :func:`profile`: one :class:`LayerProfile` per layer, plus context.

    Attributes:
        layers: per-layer figures, in model order.
        device: where the profile ran (``"meta"``, ``"cpu"``, ``"cuda:0"``).
        optimizer: the optimizer whose state was counted (``"none"`` for None).
        batch_size: rows of the sample (dim 0); activation figures are for this many rows.
        input_shape: shape of the sample, or a tuple of shapes for a tuple sample.
        input_bytes: bytes of the sample.
        storages: every storage that is kept for backward or handed between layers, with the
            layer that created it; the planner uses them to count a stage's memory exactly
            (what crosses a stage boundary is held on both sides).
        shard: the data-parallel ranks each stage's state is split over (1: not split; see
            :func:`pipepar.planner.sharded_state.sharded`).

    Example:
        >>> prof = pipepar.profile(zoo.mlp(depth=2, width=16), torch.randn(8, 16))
        >>> len(prof.layers)
        4
        >>> pipepar.plan(prof, devices=2).balance
        [2, 2]
    """

    layers: list[LayerProfile]
    device: str
    optimizer: str
    batch_size: int
    input_shape: Shape
    input_bytes: int
    storages: list[StorageRecord] = field(default_factory=list, repr=False)
    trained: list[list[ParamSpec]] = field(default_factory=list, repr=False)
    shard: int = 1

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def timed(self) -> bool:
        """Whether every layer has measured forward and backward times."""
        return all(layer.time_ms is not None for layer in self.layers)

    def with_optimizer(self, optimizer: object) -> Profile:
        """The same profile with optimizer state counted for another optimizer.

        Example:
            >>> prof.with_optimizer("sgd").layers[0].optimizer_bytes
            0
        """
        spec = resolve_optimizer(optimizer)
        if spec.name == self.optimizer:
            return self
        if len(self.trained) != len(self.layers):
            raise ValueError(
                f"optimizer={spec.name!r}, but this profile counts {self.optimizer!r} and "
                "carries no parameter shapes to count another (built or edited by hand); pass "
                f"optimizer=None or {self.optimizer!r} to take its optimizer_bytes as they are, "
                "or profile the model with pipepar.profile(..., optimizer=...)"
            )
        layers = []
        for layer, specs in zip(self.layers, self.trained):
            meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
            loop = optimizer_cost(spec, meta, foreach=False)
            multi = optimizer_cost(spec, meta, foreach=True)
            layers.append(
                replace(
                    layer,
                    optimizer_bytes=loop.state_bytes,
                    optimizer_step_bytes=loop.step_bytes,
                    optimizer_step_foreach_bytes=multi.step_bytes,
                )
            )
        return replace(self, layers=layers, optimizer=spec.name)

    def total(self, field_name: str) -> int:
        """Sum of one byte field over all layers, e.g. ``prof.total("params_bytes")``."""
        return int(sum(getattr(layer, field_name) for layer in self.layers))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, numbers) for JSON."""
        layers = [asdict(layer) | {"peak_bytes": layer.peak_bytes} for layer in self.layers]
        return {
            "device": self.device,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "input_shape": self.input_shape,
            "input_bytes": self.input_bytes,
            "layers": layers,
        }


def profile(
    model: nn.Sequential,
    sample: torch.Tensor | Sequence[torch.Tensor],
    *,
    device: str | torch.device = "meta",
    optimizer: object = "adam",
) -> Profile:
    """Measure each layer's memory (and time, on real devices) for one training step.

    The model is not modified: layers run with stand-in parameters (copies on ``device``, or the
    parameters themselves when already there) through ``torch.func.functional_call``, and
    gradients are returned, not accumulated into ``.grad``.

    Args:
        model: the ``nn.Sequential`` to profile; each child is one layer. Layers may take and
            return tuples of tensors.
        sample: an input batch (a tensor, or a tuple of tensors; dim 0 is the batch).
        device: ``"meta"`` (no memory used, no times), ``"cpu"`` or a CUDA device.
        optimizer: whose state to count: ``"adam"``, ``"adamw"``, ``"sgd"``,
            ``"sgd-momentum"``, ``"rmsprop"``, None, or a ``torch.optim.Optimizer`` subclass.

    Returns:
        The :class:`Profile` of the whole sample batch.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential`` or ``sample`` holds no tensor.
        ValueError: an empty model, an unknown device or optimizer.

    Example:
        >>> model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        >>> prof = pipepar.profile(model, torch.randn(64, 1024), device="meta")
        >>> prof.layers[0].optimizer_bytes == 2 * prof.layers[0].params_bytes  # Adam
        True
    """
    layers = list(validation.check_model(model, "model"))
    target = check_device(device)
    spec = resolve_optimizer(optimizer)
    # Each run starts from the model as passed; afterwards it is as passed (untouched).
    with training_step(), untouched(model) as passed:
        x = _on_device(_check_sample(sample), target)
        params = [stand_ins(layer, target) for layer in layers]
        traces, records = trace_layers(layers, x, params, target)
        passed.restore()
        deferred = deferred_grads(layers, x)
        passed.restore()
        times = time_layers(layers, x, params, target) if target.type != "meta" else None
    costs = _parameter_costs(layers, spec)
    profiles = []
    # model._modules, not named_children(): a module used twice is two layers.
    for i, (name, layer) in enumerate(zip(model._modules, layers)):
        t = traces[i]
        fwd, bwd = times[i] if times is not None else (None, None)
        profiles.append(
            LayerProfile(
                index=i,
                name=name,
                type_name=type(layer).__name__,
                output_shape=t.output_shape,
                activation_bytes=sum(r.nbytes for r in records if r.saved and r.creator == i),
                output_bytes=t.output_bytes,
                forward_peak_bytes=t.forward_peak,
                backward_peak_bytes=t.backward_peak,
                backward_inner_bytes=t.backward_inner,
                forward_ms=fwd,
                backward_ms=bwd,
                modifies_input=t.modifies_input,
                reuses_grad=t.reuses_grad,
                backward_points=t.backward_points,
                retained_points=t.retained_points,
                deferred_grad_bytes=deferred[i].nbytes,
                keeps_incoming_grad=deferred[i].keeps_incoming,
                splits_backward=deferred[i].splits,
                generic_params=deferred[i].generic,
                direct_grad_bytes=deferred[i].direct_bytes,
                direct_saved_bytes=deferred[i].saved_bytes,
                direct_saved_input_bytes=deferred[i].saved_input_bytes,
                whole_direct_grad_bytes=deferred[i].whole_direct_bytes,
                split_input_peak_bytes=deferred[i].input_peak,
                largest_matrix=deferred[i].largest,
                **costs[i],
            )
        )
    first = x if isinstance(x, torch.Tensor) else next(t for t in x if torch.is_tensor(t))
    kept = [r for r in records if r.saved or r.last_output is not None]
    logger.debug("profiled %d layers on %s (%d storages kept)", len(layers), target, len(kept))
    return Profile(
        layers=profiles,
        device=str(target),
        optimizer=spec.name,
        batch_size=int(first.shape[0]) if first.dim() else 1,
        input_shape=_shape(x),
        input_bytes=sum(r.nbytes for r in records if r.creator == -1),
        storages=kept,
        trained=_trained_specs(layers),
    )


@contextlib.contextmanager
def training_step() -> Iterator[None]:
    """Autograd on while a profile measures a training step, whatever the caller's mode: from
    inside ``torch.no_grad()`` no graph would be kept (every activation and backward figure
    read 0), and inside ``torch.inference_mode()`` no tensor could be differentiated."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def usable(value: Any) -> Any:
    """``value``, or a copy of it if it is an inference tensor (made under
    ``torch.inference_mode()``, which autograd cannot record); call it in :func:`training_step`."""
    return value.clone() if isinstance(value, torch.Tensor) and value.is_inference() else value


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device to profile on; ValueError if it is not one or is absent."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device={device!r} is not a torch device; use 'meta', 'cpu' or 'cuda:0'"
        ) from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but CUDA is not available here; use device='meta' to plan "
            "without a GPU, or device='cpu'"
        )
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def _check_sample(sample: object) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in sample):
        return tuple(sample)
    raise TypeError(
        f"sample must be a tensor or a tuple of tensors (batch in dim 0), got "
        f"{type(sample).__name__}; pass e.g. sample=torch.randn(64, 3, 224, 224)"
    )


def _on_device(sample: Any, device: torch.device) -> Any:
    """A private copy of the sample on ``device`` (in-place first layers must not touch it)."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device.type == "meta":
            return torch.empty_like(t, device=device)
        return t.detach().to(device, copy=True)

    return move(sample) if isinstance(sample, torch.Tensor) else tuple(move(t) for t in sample)


def _shape(value: Any) -> Shape:
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, torch.Size):
        return tuple(int(d) for d in value)
    if isinstance(value, (tuple, list)):
        return tuple(_shape(v) for v in value)
    return ()


def _trained_specs(layers: list[nn.Module]) -> list[list[ParamSpec]]:
    """Shape and dtype of each layer's trained parameters (shared ones at their first layer)."""
    seen: set[int] = set()
    out = []
    for layer in layers:
        specs = []
        for param in layer.parameters():
            key = storage_key(param)
            if key not in seen:
                seen.add(key)
                if param.requires_grad:
                    specs.append((tuple(param.shape), param.dtype))
        out.append(specs)
    return out


def _parameter_costs(layers: list[nn.Module], spec: OptimizerSpec) -> list[dict[str, int]]:
    """Parameter, gradient and optimizer bytes per layer; shared parameters count once."""
    seen: set[int] = set()
    costs = []
    for layer in layers:
        own = []
        for param in layer.parameters():
            key = storage_key(param)
            if key not in seen:
                seen.add(key)
                own.append(param)
        trained = [p for p in own if p.requires_grad]
        loop = optimizer_cost(spec, trained, foreach=False)
        multi = optimizer_cost(spec, trained, foreach=True)
        costs.append(
            {
                "params_bytes": sum(_nbytes(p) for p in own),
                "grads_bytes": sum(_nbytes(p) for p in trained),
                "optimizer_bytes": loop.state_bytes,
                "optimizer_step_bytes": loop.step_bytes,
                "optimizer_step_foreach_bytes": multi.step_bytes,
            }
        )
    return costs


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
