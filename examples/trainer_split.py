"""Train GPT-2 split across devices with Hugging Face's Trainer, which gets the pipe unchanged.

A small GPT-2 is built from a config with random weights (nothing is downloaded), wrapped in a
two-stage pipe, and handed to ``transformers.Trainer`` as if it were the model. The pipe
shows the model's ``forward`` signature (Trainer keeps the dataset columns the model takes and
finds its labels), answers the model's attributes (``config``, ``loss_type``...), and says
where it sits in ``hf_device_map``, so Trainer neither moves it nor wraps it. The data are
synthetic counting sequences of varied lengths, right-padded, labels ``-100`` on the padding,
so the loss visibly falls and gradient accumulation counts the real tokens.

    python examples/trainer_split.py
    python examples/trainer_split.py --chunks 2 --accumulate 4 --steps 60
    python examples/trainer_split.py --devices cuda:0,cuda:1 --layers 12 --hidden 768 --heads 12

TrainingArguments are the defaults but for a CPU box without internet: a temporary
``output_dir``, ``report_to="none"``, a few steps of a small batch, a larger learning rate
for a model that starts from scratch, and ``save_strategy="no"`` (Trainer saves a model that
is not a ``PreTrainedModel`` with safetensors, which refuses GPT-2's tied embedding and head;
``pipe.save_pretrained``, the model's own, saves it as transformers does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

try:
    from models import transformers_zoo as zoo
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import transformers_zoo as zoo

import pipepar

PAD = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv=None``: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated stage devices")
    parser.add_argument(
        "--split", default=None, help="module paths where stages begin (default: the middle block)"
    )
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--schedule", default="gpipe", help="gpipe, 1f1b, zb-h1, ...")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32, help="tokens per row, padding included")
    parser.add_argument("--rows", type=int, default=512, help="rows in the synthetic dataset")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per device batch")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (max_steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5, help="logging_steps")
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class Counting(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Counting sequences (each token the previous plus one, from a random start) of random
    lengths, right-padded: ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(1, vocab, (rows, 1), generator=gen)
        counted = 1 + (start + torch.arange(seq) - 1) % (vocab - 1)  # tokens 1.., 0 is padding
        lengths = torch.randint(seq // 2, seq + 1, (rows, 1), generator=gen)
        self.mask = (torch.arange(seq) < lengths).long()
        self.ids = counted.masked_fill(self.mask == 0, PAD)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def training_arguments(args: argparse.Namespace, output_dir: str) -> Any:
    """The defaults but what a CPU box without internet needs (see the module docstring)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        report_to="none",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr,
        logging_steps=args.log_every,
        save_strategy="no",
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> list[float]:
    """Train and return the logged losses."""
    from transformers import Trainer

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = zoo.gpt2(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        positions=args.seq,
    )
    pipe = pipepar.wrap(
        model,
        split=args.split.split(",") if args.split else [f"transformer.h.{args.layers // 2}"],
        devices=args.devices.split(","),
        chunks=args.chunks,
        schedule=args.schedule,
    )
    for j, paths in enumerate(pipe.stage_paths):
        print(f"stage {j} on {pipe.devices[j]}: {paths[0]} .. {paths[-1]} ({len(paths)} units)")
    print(f"Trainer sees {type(pipe).__name__} with forward{_shown_signature(pipe)}")
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(
            model=pipe,
            args=training_arguments(args, args.output_dir or scratch),
            train_dataset=Counting(args.rows, args.seq, args.vocab, args.seed),
        )
        trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    for entry in logged:
        print(
            f"step {entry['step']:3d}  loss {entry['loss']:.4f}  grad norm {entry['grad_norm']:.3f}"
        )
    losses = [float(e["loss"]) for e in logged]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    pipe.close()
    return losses


def _shown_signature(pipe: torch.nn.Module) -> str:
    import inspect

    names = list(inspect.signature(pipe.forward).parameters)
    return f"({', '.join(names[:3])}, ...)" if len(names) > 3 else f"({', '.join(names)})"


if __name__ == "__main__":
    main()
