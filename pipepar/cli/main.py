"""The ``pipepar`` command line.

    pipepar profile MODEL --input-shape 64,3,224,224 --devices 4 --capacity 16GiB --chunks 8 \\
        --optimizer adam [--schedule 1f1b] [--json plan.json] [--html report.html]
    pipepar plan pipepar.zoo:llama3_70b --tokens 8,4096 --dtype bfloat16 \\
        --devices 8 --capacity 80GiB --chunks 8 --checkpoint always --schedule 1f1b
    pipepar plan --hf-config path/to/config.json --tokens 8,4096 --devices 8 --capacity 80GiB
    pipepar plan pipepar.zoo:llama3_70b --tokens 8,4096 --dtype bfloat16 \\
        --devices 64 --capacity 80GiB --cluster h100x8 --batch 512 [--top 5] [--dp-shard both] \\
        [--offload auto]
    pipepar convert CKPT_DIR OUT.pt

MODEL is one of pipepar's example models (``pipepar.zoo:alexnet``, ``pipepar.zoo:llama3_70b``:
:mod:`pipepar.zoo`), a torchvision model (``torchvision.models.resnet50`` or just ``resnet50``) or
a model of one's own: ``package.module:function``, a function returning an ``nn.Module``,
imported from the installed packages or else from the current directory. ``profile``
flattens models that are not an ``nn.Sequential`` with :func:`pipepar.sequentialize`; ``plan``
takes any model as it is and plans over its units (:func:`pipepar.units`: what
``pipepar.wrap(model, balance=...)`` counts), building it on meta by default, and feeds it
``--tokens B,T`` as ``input_ids=`` and ``labels=`` (a language model's own loss) or an
``--input-shape`` tensor; with ``--cluster`` and ``--batch`` it searches the whole layout
(:func:`pipepar.search_layouts`: pp x dp, the replicas' state sharded or replicated, schedule,
chunks, recompute, balance) and prints the fastest that fit, the best one's plan (with its
predicted timeline) first. ``convert`` turns a sharded checkpoint directory
(what ``pipepar.distributed.save_checkpoint`` writes) into one file, ``{"model": state_dict,
"optimizer": ..., ...}`` (:func:`pipepar.persist.sharded.to_single_file`). Exit status: 0 when
the plan fits (or the file is written), 1 when no split fits, 2 for bad arguments (one line on
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch

from pipepar.cli.model_loader import load_hf_config, load_model, load_module
from pipepar.core.named_schedules import NAMES
from pipepar.core.units import parse_bytes
from pipepar.planner.optimizer_state import resolve_optimizer
from pipepar.planner.plan_targets import resolve_targets
from pipepar.planner.profile import check_device

__all__ = ["main"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "long": torch.long,
    "int64": torch.long,
    "int32": torch.int32,
}


class UsageError(Exception):
    """A bad command-line argument: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, not the usage block
        raise UsageError(message)


def _model_names() -> str:
    """How MODEL is named, for the help."""
    from pipepar import zoo

    return (
        f"MODEL: pipepar.zoo:NAME for pipepar's example models ({', '.join(zoo.__all__)}), a "
        "torchvision model (resnet50), or a model of your own as package.module:function, a "
        "function returning an nn.Module (its keyword arguments: --model-kwargs), imported "
        "from the installed packages or else from the current directory."
    )


def _parser() -> argparse.ArgumentParser:
    models = _model_names()
    parser = _Parser(
        prog="pipepar", description="Plan and inspect pipeline-parallel splits.", epilog=models
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "profile", help="profile a model and plan its split over devices", epilog=models
    )
    p.add_argument(
        "model", help="pipepar.zoo:alexnet, resnet50 (torchvision) or your package.module:function"
    )
    p.add_argument("--input-shape", required=True, help="sample shape, batch first: 64,3,224,224")
    _common(p)
    q = sub.add_parser(
        "plan", help="plan any model (transformers too) over its units", epilog=models
    )
    q.add_argument(
        "model",
        nargs="?",
        default=None,
        help="pipepar.zoo:llama3_70b or your package.module:function (or --hf-config)",
    )
    q.add_argument("--hf-config", metavar="FILE", help="a transformers config.json (or folder)")
    q.add_argument("--tokens", help="token ids B,T passed as input_ids= and labels=: 8,4096")
    q.add_argument("--input-shape", help="or one tensor argument, batch first: 64,3,224,224")
    q.add_argument(
        "--dtype",
        default=None,
        choices=sorted(k for k, v in _DTYPES.items() if v.is_floating_point),
        help="cast the model's floating-point weights (an HF config's own dtype by default)",
    )
    _common(q)
    q.add_argument(
        "--cluster",
        help="search the layout on this cluster (h100x8, a100x8, h200x8, cpu): pp x dp, "
        "schedule, chunks and recompute are then searched, not taken from the options",
    )
    q.add_argument("--batch", type=int, help="with --cluster: the global batch in rows")
    q.add_argument("--top", type=int, default=5, help="with --cluster: layouts to show")
    q.add_argument(
        "--dp-shard",
        default="both",
        choices=list(_DP_SHARD),
        help="with --cluster: for dp >= 2, try each stage's state sharded over the replicas "
        "(dp_shard=True), replicated, or both (default)",
    )
    q.add_argument(
        "--offload",
        default="auto",
        choices=list(_OFFLOAD),
        help="with --cluster: activation offload where a layout does not fit without it, on "
        "devices with memory of their own such as GPUs, never on the CPU (auto, the "
        "default), in every layout (yes), or never (no)",
    )
    c = sub.add_parser("convert", help="turn a sharded checkpoint directory into one .pt file")
    c.add_argument("checkpoint", help="the directory pipepar.distributed.save_checkpoint wrote")
    c.add_argument("out", help="the file to write, e.g. model.pt")
    return parser


_DP_SHARD = {"both": (False, True), "yes": (True,), "no": (False,)}
"""``--dp-shard``: the ``shards`` of :func:`pipepar.search_layouts`."""
_OFFLOAD: dict[str, tuple[bool, ...] | None] = {"auto": None, "yes": (True,), "no": (False,)}
"""``--offload``: the ``offloads`` of :func:`pipepar.search_layouts` (auto: the search's)."""


def _common(p: argparse.ArgumentParser) -> None:
    """The options ``profile`` and ``plan`` share."""
    p.add_argument("--input-dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--vocab", type=int, default=None, help="token id range for integer inputs")
    p.add_argument("--devices", default="4", help="a count (4) or names (cuda:0,cuda:1)")
    p.add_argument(
        "--capacity", default=None, help="per device: 16GiB, or one per device: 16GiB,24GiB"
    )
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch (M)")
    p.add_argument(
        "--optimizer", default="adam", help="adam, adamw, sgd, sgd-momentum, rmsprop or none"
    )
    p.add_argument("--schedule", default="gpipe", choices=list(NAMES))
    p.add_argument(
        "--checkpoint", default="except_last", choices=["always", "except_last", "never"]
    )
    p.add_argument(
        "--shard",
        type=int,
        default=1,
        help="data-parallel ranks each stage's state is split over (dp_shard=True); 1: none",
    )
    p.add_argument(
        "--profile-device", default="meta", help="meta (default, no memory), cpu or cuda:0"
    )
    p.add_argument(
        "--model-kwargs", default="{}", help='JSON keyword arguments for the builder: {"depth": 4}'
    )
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON ('-' for stdout)")
    p.add_argument("--html", metavar="FILE", help="write the HTML report")
    p.add_argument("--quiet", action="store_true", help="do not print the table")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        0 when the plan fits (or convert wrote its file), 1 when nothing fits, 2 for bad
        arguments.

    Example:
        >>> main(["profile", "pipepar.zoo:mlp", "--input-shape", "32,1024", "--devices", "2"])
        0
    """
    _search_current_directory()
    try:
        args = _parser().parse_args(argv)
        commands = {"plan": _plan_units, "profile": _profile, "convert": _convert}
        return commands[args.command](args)
    except UsageError as err:
        print(f"pipepar: error: {err}", file=sys.stderr)
        return 2
    except PlanError as err:
        print(f"pipepar: {err}", file=sys.stderr)
        return 1


def _search_current_directory() -> None:
    """Let MODEL name a module in the current directory (``mymodels:build``), as ``python -m``
    would: the ``pipepar`` command itself starts with only its own folder and the installed
    packages on the path. Added last, so that a folder here never hides an installed package."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


class PlanError(Exception):
    """No split fits: exit status 1."""


def _convert(args: argparse.Namespace) -> int:
    from pipepar.persist.sharded import to_single_file

    out = _guard(lambda: to_single_file(args.checkpoint, args.out))
    print(f"wrote {out} (torch.load(path, weights_only=True)['model'] is the model's state_dict)")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import pipepar

    options = _options(args)
    model = _guard(lambda: load_model(args.model, device=args.profile_device, **options.kwargs))
    sample = _sample(options.shape, options.dtype, args.vocab, args.profile_device)
    prof = _guard(
        lambda: pipepar.profile(
            model, sample, device=args.profile_device, optimizer=options.optimizer
        )
    )
    return _plan_and_write(args, options, prof)


def _plan_and_write(args: argparse.Namespace, options: _Options, prof: Any) -> int:
    """Plan ``prof`` as the arguments say, print and write it; the exit status."""
    import pipepar

    # Device and capacity lists that do not match each other or the model are bad arguments.
    _guard(lambda: resolve_targets(options.devices, options.capacity, layers=len(prof)))
    try:
        plan = pipepar.plan(
            prof,
            devices=options.devices,
            capacity=options.capacity,
            optimizer=options.optimizer,
            chunks=args.chunks,
            schedule=args.schedule,
            checkpoint=args.checkpoint,
            shard=args.shard,
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    if not args.quiet:
        _print_table(plan)
    if args.json:
        text = plan.to_json()
        if args.json == "-":
            print(text)
        else:
            _write(args.json, text)
    if args.html:
        from pipepar.render.report_html import write_html

        _guard(lambda: write_html(plan, args.html))
    return 0 if all(s.fits for s in plan.stages) else 1


@dataclass(frozen=True)
class _Options:
    """The checked arguments of ``pipepar profile``."""

    optimizer: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    devices: int | list[str]
    capacity: int | list[int] | None
    kwargs: dict[str, Any]


def _plan_units(args: argparse.Namespace) -> int:
    """``pipepar plan``: any model, built as it is, profiled per unit, planned."""
    from pipepar.planner.model_profile import profile_model

    options = _options(args)
    devices = _search_devices(args, options)
    model = _guard(lambda: _unit_model(args, options))
    sample = _unit_sample(args, options, model)
    prof = _guard(
        lambda: profile_model(
            model, sample, device=args.profile_device, optimizer=options.optimizer
        )
    )
    if devices is not None:
        return _search_and_write(args, options, devices, prof, (model, sample))
    return _plan_and_write(args, options, prof)


def _search_devices(args: argparse.Namespace, options: _Options) -> int | None:
    """With ``--cluster`` and ``--batch`` (a layout search), the device count; else None."""
    if args.cluster is None and args.batch is None:
        for flag, value, default in (
            ("--dp-shard", args.dp_shard, "both"),
            ("--offload", args.offload, "auto"),
        ):
            if value != default:
                raise UsageError(f"{flag} goes with --cluster and --batch (a layout search)")
        return None
    from pipepar.planner.cluster import Cluster

    if args.cluster is None or args.batch is None:
        raise UsageError("--cluster and --batch go together: e.g. --cluster h100x8 --batch 512")
    _guard(lambda: Cluster.named(args.cluster))
    if args.shard != 1:
        raise UsageError(
            f"--shard {args.shard} is for one plan; with --cluster the search picks the shard "
            "group (dp): pass --dp-shard yes to try only sharded replicas"
        )
    for flag, value in (("--batch", args.batch), ("--top", args.top)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1")
    if not isinstance(options.devices, int) or isinstance(options.capacity, list):
        raise UsageError(
            "--cluster searches over a count of identical devices: pass --devices 64 and one "
            "--capacity, e.g. 80GiB"
        )
    return options.devices


def _search_and_write(
    args: argparse.Namespace, options: _Options, devices: int, prof: Any, inputs: tuple[Any, Any]
) -> int:
    """Search the layouts, print them (the best one's plan first) and write them."""
    from pipepar.planner.flop_count import count_flops
    from pipepar.planner.layout import layouts_json
    from pipepar.planner.layout_search import search_layouts

    flops = None if prof.timed else _guard(lambda: count_flops(*inputs, prof))
    try:
        layouts = search_layouts(
            prof,
            devices=devices,
            batch=args.batch,
            cluster=args.cluster,
            capacity=options.capacity,  # type: ignore[arg-type]
            optimizer=options.optimizer,
            flops=flops,
            top=args.top,
            shards=_DP_SHARD[args.dp_shard],
            offloads=_OFFLOAD[args.offload],
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    if not args.quiet:
        _print_table(layouts[0].plan)
        _print_layouts(layouts)
    if args.json == "-":
        print(layouts_json(layouts))
    elif args.json:
        _write(args.json, layouts_json(layouts))
    if args.html:
        from pipepar.render.report_html import write_html

        _guard(lambda: write_html(layouts[0].plan, args.html))
    return 0


def _unit_model(args: argparse.Namespace, options: _Options) -> torch.nn.Module:
    if (args.model is None) == (args.hf_config is None):
        raise UsageError(
            "pass a MODEL (e.g. pipepar.zoo:llama3_70b) or --hf-config "
            "path/to/config.json, one of the two"
        )
    device = args.profile_device
    if args.hf_config is not None:
        model = load_hf_config(args.hf_config, device=device, **options.kwargs)
    else:
        model = load_module(args.model, device=device, **options.kwargs)
    dtype = _DTYPES[args.dtype] if args.dtype else _config_dtype(model)
    return model.to(dtype) if dtype is not None else model


def _config_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a transformers config names (Llama 3's is bfloat16), else None."""
    config = getattr(model, "config", None)
    if config is None:  # not a transformers model: its own dtype
        return None
    # transformers 5 calls it dtype (reading torch_dtype there warns); 4 calls it torch_dtype.
    name = "dtype" if hasattr(type(config), "dtype") or "dtype" in vars(config) else "torch_dtype"
    dtype = getattr(config, name, None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _unit_sample(args: argparse.Namespace, options: _Options, model: torch.nn.Module) -> Any:
    """``--tokens B,T``: ``dict(input_ids=ids, labels=ids)``, ids below the vocabulary (given,
    or the model config's); ``--input-shape``: one tensor, as for ``profile``. Ids are made on
    the CPU (a few MB at most): a meta profile reads their values where the model checks them."""
    if (args.tokens is None) == (args.input_shape is None):
        raise UsageError(
            "pass --tokens B,T (token ids) or --input-shape (a tensor), one of the two"
        )
    if args.input_shape is not None:
        return _sample(_shape(args.input_shape), options.dtype, args.vocab, args.profile_device)
    shape = _shape(args.tokens, flag="--tokens", example="8,4096")
    if len(shape) != 2:
        raise UsageError(
            f"--tokens {args.tokens!r} must be two numbers, batch and sequence: 8,4096"
        )
    vocab = args.vocab or getattr(getattr(model, "config", None), "vocab_size", None) or 2
    ids = torch.randint(0, int(vocab), shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _options(args: argparse.Namespace) -> _Options:
    if args.chunks < 1:
        raise UsageError(f"--chunks {args.chunks} must be >= 1 (micro-batches)")
    if args.shard < 1:
        raise UsageError(f"--shard {args.shard} must be >= 1 (ranks per shard group)")
    try:
        kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-kwargs {args.model_kwargs!r} is not JSON ({err.msg})") from None
    if not isinstance(kwargs, dict):
        raise UsageError(
            "--model-kwargs must be a JSON object like '{\"depth\": 4}', "
            f"got {args.model_kwargs!r}"
        )
    optimizer = None if args.optimizer == "none" else args.optimizer
    _guard(lambda: resolve_optimizer(optimizer))
    try:
        check_device(args.profile_device)
    except ValueError as err:
        raise UsageError(f"--profile-device {args.profile_device!r}: {err}") from None
    if args.vocab is not None and args.vocab < 1:
        raise UsageError(f"--vocab {args.vocab} must be at least 1 (token ids are 0..vocab-1)")
    return _Options(
        optimizer=optimizer,
        shape=_shape(args.input_shape) if args.input_shape is not None else (),
        dtype=_DTYPES[args.input_dtype],
        devices=_devices(args.devices),
        capacity=_capacity(args.capacity),
        kwargs=kwargs,
    )


def _shape(
    text: str, flag: str = "--input-shape", example: str = "64,3,224,224"
) -> tuple[int, ...]:
    message = f"{flag} {text!r} must be positive ints, batch first, e.g. {example}"
    if not re.fullmatch(r"\s*\d+(\s*[,x]\s*\d+)*\s*", text):
        raise UsageError(message)
    shape = tuple(int(d) for d in re.split(r"[,x]", text))
    if any(d < 1 for d in shape):
        raise UsageError(message)
    return shape


def _devices(text: str) -> int | list[str]:
    if text.strip().isdigit():
        if int(text) < 1:
            raise UsageError(f"--devices {text} must be at least 1")
        return int(text)
    names = [d.strip() for d in text.split(",") if d.strip()]
    for name in names:
        try:
            torch.device(name)
        except (RuntimeError, TypeError):
            raise UsageError(
                f"--devices has {name!r}, not a device name; use e.g. 4 or cuda:0,cuda:1"
            ) from None
    return names


def _capacity(text: str | None) -> int | list[int] | None:
    if text is None:
        return None
    try:
        parts = [parse_bytes(p.strip(), name="--capacity") for p in text.split(",")]
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    return parts[0] if len(parts) == 1 else parts


def _sample(
    shape: tuple[int, ...], dtype: torch.dtype, vocab: int | None, device: str
) -> torch.Tensor:
    where = "meta" if device == "meta" else "cpu"
    try:
        if dtype.is_floating_point:
            return torch.zeros(shape, dtype=dtype, device=where)
        return torch.randint(0, vocab or 2, shape, dtype=dtype, device="cpu").to(where)
    except RuntimeError as err:  # sizes that overflow, or more memory than this machine has
        first = str(err).splitlines()[0]
        raise UsageError(f"--input-shape {','.join(map(str, shape))}: {first}") from None


_T = TypeVar("_T")


def _guard(fn: Callable[[], _T]) -> _T:
    """Run ``fn``; a user error in it becomes a one-line usage error (exit status 2)."""
    try:
        return fn()
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as err:
        raise UsageError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def _print_table(plan: object) -> None:
    import shutil

    from pipepar.render.report import render_report

    width = max(shutil.get_terminal_size((160, 40)).columns, 100)
    sys.stdout.write(render_report(plan, width=width, color=sys.stdout.isatty()))  # type: ignore[arg-type]


def _print_layouts(layouts: Any) -> None:
    import shutil

    from pipepar.render.layout_table import render_layouts

    width = max(shutil.get_terminal_size((160, 40)).columns, 100)
    sys.stdout.write(render_layouts(layouts, width=width, color=sys.stdout.isatty()))


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
