"""The machines a plan runs on: devices per node, their memory and speed, and the links between.

A step-time prediction (:mod:`pipepar.planner.step_time`) needs what a profile cannot say: how
fast a device computes when the profile was taken on ``meta`` (no times), and how long bytes
take to cross from one device to another. A :class:`Cluster` holds those figures, as data:
named presets for common machines (:func:`Cluster.named`), or :func:`measure_local` for the
machine at hand. Devices are numbered ``0..devices-1``, node by node: device ``d`` is on node
``d // devices_per_node``, which is how torchrun numbers ranks.

The presets hold published peak figures; what a training step reaches is less, which
:attr:`Cluster.efficiency` accounts for. Latencies are not published specifications: they are
round figures for one small message; replace them with measured ones for exact predictions
(``dataclasses.replace(cluster, intra=Link(...))``).

    >>> c = Cluster.named("h100x8", nodes=2)
    >>> c.devices, c.link(0, 7) is c.intra, c.link(7, 8) is c.inter
    (16, True, True)

This module describes and measures machines; it predicts nothing and imports nothing of pipepar.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

__all__ = ["NAMES", "Cluster", "Link", "cluster_for", "device_memory", "measure_local"]

_GB = 10**9


@dataclass(frozen=True, kw_only=True)
class Link:
    """A connection between two devices, as one device sending to another sees it.

    Example:
        >>> Link(bandwidth=1e9, latency=1e-6).seconds(10**9)
        1.000001
    """

    bandwidth: float
    """Bytes per second one device sends in one direction."""
    latency: float
    """Seconds from sending a message until its first byte can be used."""

    def __post_init__(self) -> None:
        _check_positive("Link.bandwidth", self.bandwidth, "e.g. 50e9 for 50 GB/s")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(
                f"Link.latency must be a finite number of seconds >= 0, got {self.latency!r}; "
                "pass e.g. 10e-6"
            )

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over the link: latency + bytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Identical nodes of identical devices, a fast link within a node and a slower one across.

    Example:
        >>> c = Cluster.named("a100x8")
        >>> c.devices_per_node, c.memory_bytes == 80 * 10**9
        (8, True)
    """

    name: str
    """What the cluster is called, e.g. ``"h100x8"``."""
    device: str
    """The device model, e.g. ``"NVIDIA H100 SXM5 80GB"``."""
    devices_per_node: int
    """Devices in one node (GPUs, or CPU cores for the CPU runtime)."""
    nodes: int = 1
    """Number of nodes."""
    memory_bytes: int
    """Memory of one device."""
    flops: float
    """Peak dense FLOP/s of one device in the precision training runs in (16-bit on GPUs)."""
    efficiency: float
    """Fraction of :attr:`flops` a training step reaches; predictions from FLOP counts divide
    by ``flops * efficiency``. Large-model training reports about 0.4 to 0.55 (PaLM: 46%
    model FLOPs utilization; Megatron-LM, 2021: 52% of A100 peak)."""
    intra: Link
    """Link between two devices of one node."""
    inter: Link
    """Link between two devices of different nodes (each device's own share of the network)."""
    memory_bandwidth: float | None = None
    """Bytes per second one device reads or writes in its own memory (None: unknown). A step
    prediction adds each micro-batch's parameter gradients into the sums with it."""
    host: Link | None = None
    """The copy between one device's memory and the host's, each way (activation offload
    sends saved tensors over it and back): a GPU's PCIe link, its copies on a side stream
    beside compute. None: the device's memory is the host's (the CPU), and a copy is a
    ``memcpy`` on the worker at :attr:`memory_bandwidth`; offload frees no memory of the
    machine there, so the layout search chooses it only where this is set (given
    ``offload=True``, it is priced either way). Set it for a GPU cluster of your own."""

    def __post_init__(self) -> None:
        for label, value in (("devices_per_node", self.devices_per_node), ("nodes", self.nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{label} must be an int >= 1, got {value!r}; pass e.g. 8")
        _check_positive("Cluster.memory_bytes", self.memory_bytes, "e.g. 80 * 10**9")
        _check_positive("Cluster.flops", self.flops, "e.g. 989e12 for an H100")
        if not 0 < self.efficiency <= 1:
            raise ValueError(
                f"Cluster.efficiency must be in (0, 1], got {self.efficiency!r}; pass e.g. 0.5"
            )
        if self.memory_bandwidth is not None:
            _check_positive("Cluster.memory_bandwidth", self.memory_bandwidth, "e.g. 3.35e12")

    @property
    def devices(self) -> int:
        """All devices: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        """The node of device ``device`` (devices are numbered node by node)."""
        return device // self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        """The link from device ``a`` to device ``b``: :attr:`intra` within a node."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def ring(self, devices: Sequence[int]) -> Link:
        """The slowest link of a ring over ``devices`` (a collective moves at its pace)."""
        return self.intra if len({self.node_of(d) for d in devices}) <= 1 else self.inter

    @classmethod
    def named(cls, name: str, *, nodes: int = 1) -> Cluster:
        """The preset called ``name`` (one of :data:`NAMES`), with ``nodes`` nodes.

        Raises:
            ValueError: for an unknown name, listing the known ones.

        Example:
            >>> Cluster.named("h100x8").flops == 989e12
            True
        """
        build = _PRESETS.get(name)
        if build is None:
            raise ValueError(
                f"no cluster preset named {name!r}; known: {list(NAMES)}, or build a "
                "pipepar.planner.cluster.Cluster, or call measure_local() for this machine"
            )
        return replace(build(), nodes=nodes)


def _check_positive(label: str, value: float, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a number, got {type(value).__name__}; pass {example}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{label} must be finite and > 0, got {value!r}; pass {example}")


# -- presets -----------------------------------------------------------------------------------
_PCIE = Link(bandwidth=20 * _GB, latency=10e-6)
"""A GPU's copy to or from pinned host memory, each way: PCIe 4.0 x16 carries about 25 GB/s
and 5.0 x16 about 50 GB/s in theory; copies of activations, many and of many sizes, reach
less, so a round 20 GB/s (replace it with a measured link for exact predictions)."""


def _h100x8() -> Cluster:
    """NVIDIA DGX H100: 8 x H100 SXM5 80GB; BF16 dense 989 TFLOP/s each (NVIDIA's datasheet,
    1,979 with sparsity), HBM3 at 3.35 TB/s; NVLink 4, 900 GB/s per GPU both directions
    together (450 GB/s each way); 8 x 400 Gb/s ConnectX-7 InfiniBand NDR per node, one per
    GPU (50 GB/s each way)."""
    return Cluster(
        name="h100x8",
        device="NVIDIA H100 SXM5 80GB",
        devices_per_node=8,
        memory_bytes=80 * _GB,
        flops=989e12,
        efficiency=0.5,
        intra=Link(bandwidth=450 * _GB, latency=10e-6),
        inter=Link(bandwidth=50 * _GB, latency=20e-6),
        memory_bandwidth=3350 * _GB,
        host=_PCIE,
    )


def _h200x8() -> Cluster:
    """NVIDIA HGX H200: 8 x H200 SXM 141GB; the H100's compute (989 TFLOP/s BF16 dense) with
    141 GB of HBM3e at 4.8 TB/s; NVLink 4 and 8 x 400 Gb/s InfiniBand as in the DGX H100."""
    return replace(
        _h100x8(),
        name="h200x8",
        device="NVIDIA H200 SXM 141GB",
        memory_bytes=141 * _GB,
        memory_bandwidth=4800 * _GB,
    )


def _a100x8() -> Cluster:
    """NVIDIA DGX A100: 8 x A100 SXM4 80GB; BF16 dense 312 TFLOP/s each, HBM2e at 2.04 TB/s
    (NVIDIA's datasheet);
    NVLink 3, 600 GB/s per GPU both directions together (300 GB/s each way); 8 x 200 Gb/s
    ConnectX-6 InfiniBand HDR per node, one per GPU (25 GB/s each way)."""
    return Cluster(
        name="a100x8",
        device="NVIDIA A100 SXM4 80GB",
        devices_per_node=8,
        memory_bytes=80 * _GB,
        flops=312e12,
        efficiency=0.5,
        intra=Link(bandwidth=300 * _GB, latency=10e-6),
        inter=Link(bandwidth=25 * _GB, latency=20e-6),
        memory_bandwidth=2039 * _GB,
        host=_PCIE,
    )


def _cpu() -> Cluster:
    """This machine as the CPU runtime uses it: one device per core, each with an equal share of
    the memory. FP32 peak of one AVX2 core: 2 FMA units x 8 lanes x 2 FLOP x ~3 GHz, about
    96 GFLOP/s; one core streams about 10 GB/s from memory. Stages on one machine hand
    tensors over in memory (a thread hand-off); nodes meet over 10 Gb/s Ethernet.
    :func:`measure_local` measures instead."""
    cores = os.cpu_count() or 1
    return Cluster(
        name="cpu",
        device="CPU core",
        devices_per_node=cores,
        memory_bytes=max(1, _physical_memory() // cores),
        flops=96e9,
        efficiency=0.5,
        intra=Link(bandwidth=10 * _GB, latency=20e-6),
        inter=Link(bandwidth=1.25 * _GB, latency=50e-6),
        memory_bandwidth=10 * _GB,
    )


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not POSIX: assume a common size
        return 16 * 2**30


_PRESETS: dict[str, Callable[[], Cluster]] = {
    "h100x8": _h100x8,
    "h200x8": _h200x8,
    "a100x8": _a100x8,
    "cpu": _cpu,
}

NAMES = tuple(_PRESETS)
"""The names :meth:`Cluster.named` knows."""


# -- measuring the machine at hand -------------------------------------------------------------
def measure_local(device: str | torch.device = "cpu", *, seconds: float = 1.0) -> Cluster:
    """This machine, measured in about ``seconds``: matrix-product FLOP/s of one device, the
    bandwidth of a copy between devices (within one device when there is only one), the
    latency of handing a small tensor over, and the memory bandwidth of an in-place sum (as a
    gradient is added into its sum).

    On the CPU a device is one core: the product runs on one thread, as each CPU stage does.
    On CUDA it runs in BF16 on ``device``. The measured rate is what a large product reaches,
    so :attr:`Cluster.efficiency` is 1; layers of smaller products reach less. There is no
    second node to measure: :attr:`Cluster.inter` is the ``"cpu"`` preset's.

    Args:
        device: ``"cpu"`` or a CUDA device.
        seconds: the time to spend, split between the measurements.

    Returns:
        A :class:`Cluster` describing this machine, for ``predict_step`` and
        ``search_layouts`` (``cluster=``).

    Raises:
        ValueError: for a device that is not here or ``seconds`` not > 0.

    Example:
        >>> local = measure_local(seconds=0.5)
        >>> local.flops > 0 and local.intra.bandwidth > 0
        True
    """
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use 'cpu'")
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"measure_local measures 'cpu' or a CUDA device, got {device!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be finite and > 0, got {seconds!r}; pass e.g. 1.0")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    flops = _matmul_rate(target, seconds / 2)
    bandwidth = _copy_rate(target, seconds / 4)
    latency = _handoff_latency(target, seconds / 8)
    memory = _sum_rate(target, seconds / 8)
    base = _cpu()
    if target.type == "cuda":
        props = torch.cuda.get_device_properties(target)
        base = replace(
            base,
            device=props.name,
            devices_per_node=torch.cuda.device_count(),
            memory_bytes=int(props.total_memory),
            host=_PCIE,
        )
    return replace(
        base,
        name=f"measured {target}",
        flops=flops,
        efficiency=1.0,
        intra=Link(bandwidth=bandwidth, latency=latency),
        memory_bandwidth=memory,
    )


def cluster_for(device: torch.device, count: int, *, per_node: int | None = None) -> Cluster:
    """``count`` devices like ``device``, ``per_node`` on each node (default: all on one).

    CPU: the ``"cpu"`` preset with each device a share of this machine's memory. CUDA: the
    preset whose GPU the device's name names (``"H100"`` in ``"NVIDIA H100 80GB HBM3"``) with
    the device's own memory, else this machine measured (:func:`measure_local`, half a second).

    Example:
        >>> cluster_for(torch.device("cpu"), 2).devices
        2
    """
    per_node = max(1, min(per_node or count, count))
    nodes = -(-count // per_node)
    if device.type != "cuda":
        cpu = Cluster.named("cpu")
        total = cpu.memory_bytes * cpu.devices_per_node
        return replace(
            cpu, devices_per_node=per_node, nodes=nodes, memory_bytes=max(1, total // per_node)
        )
    props = torch.cuda.get_device_properties(device)
    preset = _preset_named_in(props.name)
    base = Cluster.named(preset) if preset is not None else measure_local(device, seconds=0.5)
    return replace(
        base,
        device=props.name,
        devices_per_node=per_node,
        nodes=nodes,
        memory_bytes=int(props.total_memory),
    )


def _preset_named_in(device_name: str) -> str | None:
    """The GPU preset whose model (``"h100"`` of ``"h100x8"``) the device's name contains."""
    upper = device_name.upper()
    for name in NAMES:
        model = name.split("x")[0].upper()
        if name != "cpu" and model in upper:
            return name
    return None


def device_memory(device: torch.device, sharing: int = 1) -> int:
    """Bytes one stage on ``device`` may hold: a CUDA device's total memory, or this machine's
    memory over the ``sharing`` CPU stages (or ranks) on it.

    Example:
        >>> device_memory(torch.device("cpu"), 2) > 0
        True
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return cluster_for(torch.device("cpu"), max(1, sharing)).memory_bytes


def _best_rate(
    run: Callable[[], object], work: float, budget: float, sync: Callable[[], None]
) -> float:
    """The best ``work`` per second of ``run`` over repeats within ``budget`` seconds."""
    run()  # warm-up: first calls pay for allocation and kernel selection
    sync()
    best, end = 0.0, time.perf_counter() + budget
    while True:
        start = time.perf_counter()
        run()
        sync()
        took = time.perf_counter() - start
        best = max(best, work / took) if took > 0 else best
        if time.perf_counter() >= end and best > 0:
            return best


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _matmul_rate(device: torch.device, budget: float) -> float:
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a CPU device is one core
    try:
        return _best_rate(lambda: torch.mm(a, b), 2.0 * n**3, budget, _sync(device))
    finally:
        torch.set_num_threads(threads)


def _copy_rate(device: torch.device, budget: float) -> float:
    src = torch.empty(8 << 20, dtype=torch.float32, device=device).fill_(1.0)  # 32 MiB
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    other = torch.device("cuda", ((device.index or 0) + 1) % count) if count > 1 else device
    dst = torch.empty_like(src, device=other)

    def sync() -> None:
        _sync(device)()
        _sync(other)()

    return _best_rate(lambda: dst.copy_(src), float(src.numel() * src.element_size()), budget, sync)


def _sum_rate(device: torch.device, budget: float) -> float:
    """Bytes per second that ``a += b`` moves (two read, one written) on one core or device."""
    a = torch.ones(8 << 20, dtype=torch.float32, device=device)  # 32 MiB
    b = torch.ones_like(a)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a CPU device is one core
    try:
        moved = 3.0 * a.numel() * a.element_size()
        return _best_rate(lambda: a.add_(b), moved, budget, _sync(device))
    finally:
        torch.set_num_threads(threads)


def _handoff_latency(device: torch.device, budget: float) -> float:
    """Half the round trip of a one-element tensor to another thread and back (the CPU
    runtime's hand-over between stages), or of a small copy on CUDA."""
    if device.type == "cuda":
        small = torch.ones(1, device=device)
        rate = _best_rate(lambda: small.clone(), 1.0, budget, _sync(device))
        return 1.0 / rate
    there: queue.Queue[torch.Tensor | None] = queue.Queue()
    back: queue.Queue[torch.Tensor] = queue.Queue()

    def echo() -> None:
        while (t := there.get()) is not None:
            back.put(t)

    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    small = torch.ones(1)

    def round_trip() -> None:
        there.put(small)
        back.get()

    try:
        return 0.5 / _best_rate(round_trip, 1.0, budget, lambda: None)
    finally:
        there.put(None)
        worker.join()
