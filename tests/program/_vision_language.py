"""Tiny vision-language models of transformers (random weights) and batches whose rows hold
different numbers of images, for the tests of packed multimodal inputs."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

IMAGE, VIDEO, START, END = 90, 91, 92, 93  # placeholder and marker tokens, above the text's
SPLIT = ["model.language_model.layers.1"]  # two stages: vision and one layer, then the rest
TEXT = {  # the language model: two layers of 32
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def qwen2_vl() -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config={
            **TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen2VLForConditionalGeneration(config)


def qwen2_vl_batch(rows: list[list[tuple[str, tuple[int, int, int]]]], seq: int = 20) -> dict:
    """Per row its images and videos, each ``(kind, (t, h, w))`` in patches (four per token)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 80, (len(rows), seq), generator=g)
    types = torch.zeros_like(ids)
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    for r, items in enumerate(rows):
        at = 1
        for kind, (t, h, w) in items:
            tokens = t * h * w // 4
            ids[r, at - 1], ids[r, at + tokens] = START, END
            ids[r, at : at + tokens] = IMAGE if kind == "image" else VIDEO
            types[r, at : at + tokens] = 1 if kind == "image" else 2
            grids[kind].append((t, h, w))
            at += tokens + 2
        assert at <= seq, "the row's images do not fit its tokens"
    labels = ids.clone()
    labels[:, :2] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            batch[key] = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g)
            batch[f"{kind}_grid_thw"] = grid
    return {**batch, "labels": labels}


def llava() -> nn.Module:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 8,
            "patch_size": 4,
            "projection_dim": 32,
        },
        text_config={"model_type": "llama", **TEXT},
        image_token_index=IMAGE,
        image_seq_length=4,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(config)


def llava_batch(images: list[int], seq: int = 16) -> dict[str, Tensor]:
    """``images[r]`` images in row ``r``, four tokens each."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 80, (len(images), seq), generator=g)
    for r, k in enumerate(images):
        ids[r, 1 : 1 + 4 * k] = IMAGE
    labels = ids.clone()
    labels[:, :2] = -100
    pixels = torch.randn(sum(images), 3, 8, 8, generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "labels": labels}


MODELS = {"qwen2_vl": qwen2_vl, "llava": llava}


def batch_of(name: str) -> dict[str, Tensor]:
    """Four rows: one image, none, two images of other sizes (a video too for Qwen2-VL), one."""
    if name == "llava":
        return llava_batch([1, 0, 2, 1])
    return qwen2_vl_batch(
        [
            [("image", (1, 2, 4))],
            [],
            [("image", (1, 2, 2)), ("video", (2, 2, 2)), ("image", (1, 4, 2))],
            [("image", (1, 2, 2))],
        ]
    )


def model_and_plain(name: str) -> tuple[nn.Module, nn.Module]:
    model = MODELS[name]()
    return model, copy.deepcopy(model)


def assert_grads_equal(model: nn.Module, plain: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def outputs_equal(out: Any, ref: Any, keys: tuple[str, ...]) -> None:
    for key in keys:
        if getattr(ref, key, None) is not None:
            torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
