"""Train AlexNet split across devices with ``pipepar.wrap`` (GPipe micro-batching).

The defaults run on the CPU as two pipeline stages in about a minute on two cores: small
synthetic images (a fixed, seeded set with one pattern per class, so the loss visibly falls),
a progress bar, and at the end the balance, each stage's device and the throughput. With GPUs
present, every CUDA device becomes a stage.

    python examples/alexnet_split.py
    python examples/alexnet_split.py --devices cuda:0,cuda:1 --image-size 224 --batch-size 128 \
        --chunks 8 --hidden 4096
    python examples/alexnet_split.py --original --balance 10,14 --timeline timeline.json

Without ``--balance`` the layers are split so that every stage does about the same number of
floating-point operations (counted once on one sample with ``torch.utils.flop_counter``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

try:
    import pipepar
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pipepar
from pipepar import timeline, zoo

MIN_IMAGE_SIZE = 63  # AlexNet's three 3x3/2 max pools need at least this many pixels


@dataclass
class Result:
    """What a training run measured."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    batch_size: int = 0

    def throughput(self) -> float:
        """Samples per second over the steps after the first (warm-up) step."""
        timed = self.seconds[1:] or self.seconds
        return self.batch_size * len(timed) / max(sum(timed), 1e-9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv=None``: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices",
        type=_names,
        default=None,
        help="comma-separated stage devices, e.g. cpu,cpu or cuda:0,cuda:1 "
        "(default: every CUDA device, else two CPU workers)",
    )
    parser.add_argument(
        "--balance",
        type=_ints,
        default=None,
        help="layers per stage, e.g. 10,12 (default: equal FLOPs per stage)",
    )
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument(
        "--checkpoint",
        default="except_last",
        choices=["always", "except_last", "never"],
        help="recompute in backward",
    )
    parser.add_argument("--image-size", type=int, default=64, help="square image side, >= 63")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument(
        "--hidden", type=int, default=1024, help="width of fc6/fc7 (4096 in the paper)"
    )
    parser.add_argument(
        "--batches", type=int, default=4, help="distinct synthetic batches, cycled through"
    )
    parser.add_argument(
        "--original",
        action="store_true",
        help="the 2012 paper's two-GPU AlexNet (grouped convs, LRN)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="PATH",
        help="record every stage action and draw the last step: .svg, .png, .html (chart and "
        "table per stage) or .json (Perfetto)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 10,12, got {text!r}") from None


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.image_size < MIN_IMAGE_SIZE:
        parser.error(f"--image-size {args.image_size} is too small for AlexNet; use >= 63")
    for name in ("chunks", "batch_size", "steps", "num_classes", "hidden", "batches"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {getattr(args, name)} must be >= 1")
    if args.timeline is not None and args.timeline.suffix.lower() not in timeline.SUFFIXES:
        parser.error(
            f"--timeline {args.timeline}: cannot tell the format from its suffix; "
            f"name it with one of {', '.join(timeline.SUFFIXES)}"
        )


def default_devices() -> list[str]:
    """Every CUDA device if there is one, else two CPU workers."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cpu"]


def layer_flops(model: nn.Sequential, sample: torch.Tensor) -> list[int]:
    """Forward floating-point operations of each layer on ``sample``."""
    flops = []
    x = sample
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            flops.append(counter.get_total_flops())
    return flops


def equal_flops_balance(model: nn.Sequential, sample: torch.Tensor, stages: int) -> list[int]:
    """Split ``model`` into ``stages`` contiguous runs with about equal FLOPs each.

    Cuts fall only before a layer with weights: a ReLU or pool stays with the conv or linear
    before it, so no stage starts with an in-place activation of its neighbour's output.
    """
    groups: list[list[int]] = []  # [layers, flops] per weighted layer and its followers
    for layer, flops in zip(model, layer_flops(model, sample), strict=True):
        if not groups or any(True for _ in layer.parameters(recurse=True)):
            groups.append([0, 0])
        groups[-1][0] += 1
        groups[-1][1] += flops
    if stages > len(groups):
        raise ValueError(f"{stages} stages but AlexNet has {len(groups)} weighted layers")
    per_group = pipepar.partition([max(flops, 1) for _, flops in groups], stages)
    balance, start = [], 0
    for count in per_group:
        balance.append(sum(layers for layers, _ in groups[start : start + count]))
        start += count
    return balance


def synthetic_data(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of seeded batches: each class is a noisy copy of its own smooth pattern."""
    gen = torch.Generator().manual_seed(args.seed)
    size = (args.image_size, args.image_size)
    coarse = torch.randn(args.num_classes, 3, 4, 4, generator=gen)
    patterns = F.interpolate(coarse, size=size, mode="bilinear", align_corners=False)
    data = []
    for _ in range(args.batches):
        y = torch.randint(args.num_classes, (args.batch_size,), generator=gen)
        noise = torch.randn(args.batch_size, 3, *size, generator=gen)
        data.append((patterns[y] + 0.5 * noise, y))
    return data


def build_pipe(args: argparse.Namespace, sample: torch.Tensor) -> pipepar.Pipe:
    """AlexNet split over ``args.devices`` (``trace=True`` when a timeline is asked for)."""
    model = zoo.alexnet(args.num_classes, original=args.original, hidden=args.hidden)
    devices = args.devices or default_devices()
    balance = args.balance or equal_flops_balance(model, sample[:1], len(devices))
    return pipepar.wrap(
        model,
        balance,
        devices=devices,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
        trace=args.timeline is not None,
    )


def train(
    pipe: pipepar.Pipe,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    out: TextIO,
) -> Result:
    """Run ``args.steps`` Adam steps over ``data``, drawing a progress bar on ``out``."""
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    first, last = pipe.devices[0], pipe.devices[-1]
    result = Result(batch_size=args.batch_size)
    bar = _ProgressBar(args.steps, out)
    for step in range(args.steps):
        x, y = data[step % len(data)]
        start = time.perf_counter()
        output = pipe(x.to(first, non_blocking=True))
        loss = F.cross_entropy(output, y.to(last, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(loss.item())  # .item() waits for the devices to finish
        result.seconds.append(time.perf_counter() - start)
        bar.update(step + 1, result.losses[-1], args.batch_size / result.seconds[-1])
    bar.close()
    return result


class _ProgressBar:
    """A plain-text bar: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, out: TextIO, width: int = 24) -> None:
        self.total, self.out, self.width = total, out, width
        self.live = out.isatty()

    def update(self, done: int, loss: float, rate: float) -> None:
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"step {done:>4}/{self.total} [{bar}] loss {loss:.4f}  {rate:8.1f} samples/s"
        self.out.write(("\r" + line) if self.live else line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.live:
            self.out.write("\n")


def report(pipe: pipepar.Pipe, result: Result, args: argparse.Namespace, out: TextIO) -> None:
    """Print the balance, each stage's device and layers, the loss and the throughput."""
    print(f"balance: {list(pipe.balance)}", file=out)
    first = 0
    for j, (n, device) in enumerate(zip(pipe.balance, pipe.devices, strict=True)):
        kinds = ", ".join(type(layer).__name__ for layer in list(pipe)[first : first + n])
        print(f"stage {j}: {device}  layers {first}-{first + n - 1}  ({kinds})", file=out)
        first += n
    print(f"chunks: {pipe.chunks}  checkpoint: {pipe.checkpoint}", file=out)
    losses = result.losses
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps", file=out)
    timed = "steps 2-" + str(len(losses)) if len(losses) > 1 else "step 1"
    print(f"throughput: {result.throughput():.1f} samples/s ({timed})", file=out)


def save_timeline(pipe: pipepar.Pipe, path: Path, out: TextIO) -> None:
    """Draw the last step's stage actions in the format the suffix of ``path`` names."""
    tracer = getattr(pipe, "tracer", None)
    if tracer is None:
        print("timeline: unsupported, this pipepar does not record stage actions", file=out)
        return
    last = tracer.timeline().steps()[-1]  # the last, warmed-up mini-batch
    written = timeline.save(last, path)
    print(f"timeline: {len(last.events)} events of the last step written to {written}", file=out)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Parse ``argv``, train, print the report; returns the exit status."""
    out = out or sys.stdout
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = synthetic_data(args)
    try:
        pipe = build_pipe(args, data[0][0])
    except (ValueError, TypeError) as error:  # pipepar's messages name the flag's value
        print(f"alexnet_split.py: error: {error}", file=sys.stderr)
        return 2
    print(
        f"AlexNet{' (2012, two-GPU)' if args.original else ''}: {len(pipe)} layers, "
        f"{sum(p.numel() for p in pipe.parameters()) / 1e6:.1f}M parameters, "
        f"images {args.image_size}x{args.image_size}, batch {args.batch_size}",
        file=out,
    )
    try:
        result = train(pipe, data, args, out)
    finally:
        pipe.close()  # stop the stage workers now, not when the pipe is collected
    report(pipe, result, args, out)
    if args.timeline is not None:
        save_timeline(pipe, args.timeline, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
