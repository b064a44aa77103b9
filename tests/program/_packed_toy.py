"""A toy multimodal model whose images are packed over the batch, for the tests of declared
cutting."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IMAGE = 1  # the token that stands for one patch of an image


class PackedImages(nn.Module):
    """A toy multimodal model: ``pixel_values`` holds the patches of all images of the batch
    one after another; each image token of ``input_ids`` takes the next patch's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.vision = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, pixel_values, labels=None, scale=None):
        x = self.embed(input_ids)
        image = self.vision(pixel_values)
        x = x.masked_scatter((input_ids == IMAGE).unsqueeze(-1), image)
        if scale is not None:
            x = x * scale
        for block in self.blocks:
            x = x + torch.relu(block(x))
        logits = self.head(x)
        out = {"logits": logits, "image_hidden_states": image}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def packed_batch(rows: int = 4, seq: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 16, (rows, seq), generator=g)
    ids[0, 1:4] = IMAGE  # row 0: three patches, row 1: none, row 2: one, row 3: two
    ids[2, 0] = IMAGE
    ids[3, 2:4] = IMAGE
    labels = ids.clone()
    labels[1, :3] = -100
    patches = int((ids == IMAGE).sum())
    pixels = torch.randn(patches, 4, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def patches_per_row(call: dict[str, Any]) -> torch.Tensor:
    """Each row's patches: its image tokens."""
    return (call["input_ids"] == IMAGE).sum(1)


