"""Train a small GPT with pipeline x data parallelism under torchrun (pipepar.distributed).

    torchrun --nproc-per-node 4 examples/hybrid_train.py --pp 2 --dp 2 --schedule 1f1b

``--schedule`` takes every schedule name of pipepar; with ``interleaved-1f1b`` and ``zb-v`` each
of the ``--pp`` ranks of a pipeline runs two stages (the balance lists ``2 * pp`` stages).
Each rank builds the model on the meta device and materializes only its own stages. CPU ranks
talk over gloo; with one GPU per rank (``LOCAL_RANK``) the ranks use NCCL. The data is
synthetic: sequences that count up modulo the vocabulary, so the next token is predictable and
the loss falls quickly; each step's batch is drawn from a generator seeded by the step number,
so a resumed run sees the same data as an uninterrupted one. Rank 0 prints the loss and
throughput and, at the end, saves the whole model and the optimizer state with
``ppd.save_checkpoint`` to ``--out`` (a path ending in ``.pt``: one file, ``torch.load(path)
["model"]`` is a plain state_dict that loads into the plain model or a ``pipepar.wrap`` pipe;
any other path: a directory each rank writes its part of). ``--resume PATH`` goes on from such
a checkpoint, with any --pp/--dp.

Surviving faults: ``--save-every K`` also saves to ``--out`` after every K-th step (atomically:
a rank killed mid-save leaves the previous checkpoint), and ``--resume auto`` goes on from
``--out`` if it exists, else starts afresh, so that the same command line serves the first
launch, a relaunch by hand and torchrun's own restarts (``--max-restarts``). After a rank dies
the others stop within ``--timeout`` seconds (at once when its connections close).
Multi-node runs use torchrun's usual flags (``--nnodes``, ``--rdzv-endpoint`` ...); see
``examples/slurm_train.sbatch``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `models` lives at the repo root

import models
import pipepar.distributed as ppd
from pipepar.core.named_schedules import VIRTUAL
from pipepar.persist.directories import readable


def even_balance(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as possible, extra layers on the first stages."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (j < extra) for j in range(n_stages)]


def batch(step: int, replica: int, args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """Counting sequences from random starts: ids (N, T) and next-token targets (N, T)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    start = torch.randint(args.vocab, (args.batch, 1), generator=g)
    ids = (start + torch.arange(args.seq_len + 1)) % args.vocab
    return ids[:, :-1], ids[:, 1:]


def next_token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    args = parse()
    with torch.device("meta"):  # no rank ever holds the whole model
        model = models.gpt(
            depth=args.depth, width=args.width, heads=4, vocab=args.vocab, seq_len=args.seq_len
        )
    warn_if_restarts_share_the_store()
    if args.bind_cores:  # CPU hosts: each rank's threads on cores of its own
        ppd.bind_cores()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)  # reset_parameters on replica 0, broadcast to the others
    stages = 2 * args.pp if args.schedule in VIRTUAL else args.pp  # 2 per rank: virtual stages
    pipe = ppd.wrap(
        model,
        even_balance(len(model), stages),
        chunks=args.chunks,
        schedule=args.schedule,
        dp=args.dp,
        checkpoint=args.checkpoint,
        timeout=args.timeout,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    resume = resume_path(args)
    first = ppd.load_checkpoint(resume, pipe, opt)["step"] + 1 if resume else 0
    rank0 = dist.get_rank() == 0
    if rank0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by torchrun
        print(
            f"{args.pp} ranks ({stages} stages) x {args.dp} replicas, balance {pipe.balance}, "
            f"schedule {args.schedule}, {args.chunks} micro-batches, device {pipe.device}"
            + (f", resuming at step {first} from {resume}" if resume else "")
            + (f" (torchrun restart {restarts})" if restarts != "0" else ""),
            flush=True,
        )
    start = time.perf_counter()
    for step in range(first, args.steps):
        x, y = (t.to(pipe.device) for t in batch(step, pipe.dp_rank, args))
        loss = pipe.step(x, y, next_token_loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank0 and (step % args.log_every == 0 or step == args.steps - 1):
            rate = (step + 1 - first) * args.batch * args.dp / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss:.4f}  {rate:.0f} sequences/s", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step < args.steps - 1:
            ppd.save_checkpoint(args.out, pipe, opt, extra={"step": step})  # all ranks, atomic
    # every rank takes part; atomic (weights + AdamW state; a .pt file: rank 0 writes it)
    ppd.save_checkpoint(args.out, pipe, opt, extra={"step": args.steps - 1})
    if rank0:
        print(f"saved the model and optimizer to {args.out} (--resume {args.out} goes on)")
    dist.destroy_process_group()


def warn_if_restarts_share_the_store() -> None:
    """torchrun's restarts keep the store it shares with the ranks (static rendezvous always,
    c10d by default), and what the first attempt wrote there stays: restarted ranks can read
    its addresses and fail to connect (pytorch/pytorch#135712)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarts and shared and os.environ.get("RANK") == "0":
        print(
            "warning: --max-restarts with torchrun's shared store: a restart may fail to "
            "connect; launch with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
            flush=True,
        )


def resume_path(args: argparse.Namespace) -> str | None:
    """The checkpoint to go on from: ``--resume``, where ``auto`` means ``--out`` once a save
    has put it there (a fresh start before)."""
    if args.resume != "auto":
        return args.resume
    if os.path.exists(args.out):
        return args.out
    # a save killed between its two renames leaves the previous checkpoint aside: load reads it
    aside = readable(Path(os.path.abspath(args.out)))
    return args.out if aside is not None and not args.out.endswith((".pt", ".pth")) else None


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="ranks per pipeline")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    p.add_argument(
        "--schedule",
        choices=list(ppd.SCHEDULES),
        default="1f1b",
        help="pipeline schedule; interleaved-1f1b and zb-v run 2 stages per rank",
    )
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument(
        "--checkpoint",
        default="never",
        choices=["always", "except_last", "never"],
        help="activation checkpointing: recompute in the backward (saving to disk: --out)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument(
        "--out",
        default="hybrid_checkpoint.pt",
        help="where the model and optimizer go: a .pt file (rank 0 writes it) or a directory",
    )
    p.add_argument(
        "--resume",
        default=None,
        help="a checkpoint saved by --out to go on from; 'auto': --out if it exists",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also save to --out after every K-th step (0: at the end only)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for a peer before every rank stops with an error",
    )
    p.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each rank to its share of the host's cores (CPU hosts; torchrun's "
        "LOCAL_RANK and LOCAL_WORLD_SIZE)",
    )
    args = p.parse_args()
    if args.save_every < 0:
        p.error(f"--save-every must be 0 (save at the end only) or more, not {args.save_every}")
    return args


if __name__ == "__main__":
    main()
