"""Train transformers' GPT-2 split across devices, as the model is: no rewriting, no Sequential.

A small GPT-2 is built from a config with random weights (nothing is downloaded) and trained
on synthetic counting sequences, so the loss visibly falls. The pipe
is called with the model's own arguments (``input_ids=``, ``labels=``) and ``step`` runs the
model's own loss under the chosen schedule. The token embedding and the output head share
their weight across the first and last stage.

    python examples/gpt2_split.py
    python examples/gpt2_split.py --split transformer.h.3 --schedule zb-h1 --steps 60
    python examples/gpt2_split.py --devices cuda:0,cuda:1 --layers 12 --hidden 768 --heads 12

Without ``--split`` the stages come from ``--balance`` (units per stage) if given, else from
the planner, which profiles the model on one batch; the plan's per-stage report is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    from models import transformers_zoo as zoo
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import transformers_zoo as zoo

import pipepar
from pipepar.planner.model_profile import profile_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv=None``: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated stage devices")
    parser.add_argument(
        "--split", default=None, help="module paths where stages begin, comma-separated"
    )
    parser.add_argument("--balance", default=None, help="units per stage, e.g. 5,4")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, zb-h1, ...")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def tokens(batch: int, seq: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Counting sequences from a random start (each token is the previous plus one, modulo the
    vocabulary): learnable, so the loss visibly falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    return (start + torch.arange(seq)) % vocab


def build_pipe(args: argparse.Namespace, model: torch.nn.Module, sample: dict) -> pipepar.ModelPipe:
    devices = args.devices.split(",")
    options = dict(devices=devices, chunks=args.chunks, schedule=args.schedule, sample=sample)
    if args.split:
        return pipepar.wrap(model, split=args.split.split(","), **options)
    if args.balance:
        return pipepar.wrap(model, [int(n) for n in args.balance.split(",")], **options)
    # Planned from a profile of the sample: each unit's parameters, gradients, optimizer state,
    # activations and time, then the split with the smallest bottleneck.
    prof = profile_model(model, sample)
    plan = pipepar.plan(
        prof, devices=len(devices), chunks=args.chunks, checkpoint="never",
        schedule=args.schedule, optimizer="adamw",
    )  # fmt: skip
    print(pipepar.report.table(plan, width=120))
    return pipepar.wrap(model, list(plan.balance), **options)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = zoo.gpt2(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        positions=max(64, args.seq),
    )
    sample_ids = tokens(args.batch_size, args.seq, args.vocab, gen)
    pipe = build_pipe(args, model, dict(input_ids=sample_ids, labels=sample_ids))
    for j, paths in enumerate(pipe.stage_paths):
        print(f"stage {j} on {pipe.devices[j]}: {paths[0]} .. {paths[-1]} ({len(paths)} units)")
    tied = model.lm_head.weight is model.transformer.wte.weight
    print(f"schedule {args.schedule}, {args.chunks} micro-batches, head tied to embedding: {tied}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    losses, seconds = [], []
    for step in range(args.steps):
        ids = tokens(args.batch_size, args.seq, args.vocab, gen)
        start = time.perf_counter()
        loss = pipe.step(input_ids=ids, labels=ids)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    timed = seconds[1:] or seconds
    rate = args.batch_size * args.seq * len(timed) / sum(timed)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {rate:,.0f} tokens/s")
    return losses


if __name__ == "__main__":
    main()
