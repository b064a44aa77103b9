"""Hooks on every parameter of a model that count their calls: a clamping tensor hook (not
linear: run per micro-batch it would give other gradients) and a post-accumulate-grad hook."""

from __future__ import annotations

from collections import Counter

from torch import Tensor, nn

__all__ = ["clamping_hooks"]


def clamping_hooks(model: nn.Module, limit: float) -> tuple[Counter[str], Counter[str]]:
    """Clamp every parameter's gradient to ``[-limit, limit]``; the calls of the clamps and of
    the post-accumulate-grad hooks, by parameter name."""
    clamps: Counter[str] = Counter()
    accumulated: Counter[str] = Counter()
    for name, p in model.named_parameters():

        def clamp(g: Tensor, name: str = name) -> Tensor:
            clamps[name] += 1
            return g.clamp(-limit, limit)

        p.register_hook(clamp)
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.update([name]))
    return clamps, accumulated
