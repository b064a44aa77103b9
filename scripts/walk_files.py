"""Count the files a newcomer opens to follow a pipe: every pipepar file whose code runs.

Two walks, each from ``wrap`` to the end of a backward:

- ``chain``: ``pipepar.wrap(nn.Sequential of 8 layers, balance=[3, 3, 2])``, then
  ``pipe(x).sum().backward()``;
- ``transformers``: a 4-layer GPT-2 from a config, ``pipepar.wrap(model, balance=[5, 4])``,
  then ``pipe(input_ids=..., labels=...).loss.backward()``.

A profile function on every thread records the files of the functions that run (``pipepar``
is imported before: a walk starts at ``wrap``); the script
prints, per walk, how many files of ``pipepar/`` that is and how many lines they hold.

    python scripts/walk_files.py            # both walks
    python scripts/walk_files.py --list     # and the files
"""

from __future__ import annotations

import argparse
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

PACKAGE = Path(__file__).resolve().parents[1] / "pipepar"


def files_run(walk: Callable[[], None]) -> set[Path]:
    """The pipepar files whose functions run during ``walk`` (on any thread)."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        # Functions only: a module's or a class's body runs once, on import.
        if event == "call" and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            seen.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        walk()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return {Path(f) for f in seen if Path(f).is_relative_to(PACKAGE)}


def chain_walk() -> None:
    import pipepar

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    pipe = pipepar.wrap(model, balance=[3, 3, 2], devices=["cpu"] * 3, chunks=4)
    pipe(torch.randn(8, 16)).sum().backward()


def transformers_walk() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    import pipepar

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(config)
    pipe = pipepar.wrap(model, balance=[5, 4], devices=["cpu"] * 2, chunks=2)
    ids = torch.randint(0, 64, (4, 16))
    pipe(input_ids=ids, labels=ids).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the files too")
    args = parser.parse_args()
    import pipepar  # noqa: F401  (imported before the walks: following starts at wrap)

    for name, walk in (("chain", chain_walk), ("transformers", transformers_walk)):
        files = files_run(walk)
        lines = sum(len(f.read_text().splitlines()) for f in files)
        print(f"{name}: {len(files)} files, {lines} lines")
        if args.list:
            for f in sorted(files):
                print(f"  {f.relative_to(PACKAGE.parent)} ({len(f.read_text().splitlines())})")


if __name__ == "__main__":
    main()
