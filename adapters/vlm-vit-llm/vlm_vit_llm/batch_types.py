"""The types a `MultimodalLM` batch is made of: `MultimodalBatch` (prompts as the LLM runs
them), `TiledImage` (one image as a tiled tower takes it), `Video` (a clip) and
`IGNORE_INDEX`. A leaf: it imports nothing of the plugin, so every module can use these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100  # label positions the loss skips (Hugging Face's convention)


@dataclass
class MultimodalBatch:
    """Prompts (and targets) tokenised, with every image placeholder expanded.

    Attributes:
        input_ids: `[B, L]`; image positions hold the image token's id, padding the pad id.
        attention_mask: `[B, L]`, 0 on padding.
        position_ids: `[B, L]`, counting real tokens only (so left padding shifts nothing);
            for a multimodal-RoPE LLM `[3, B, L]` (padded) or `[4, R, L]` (packed: the text
            positions first), as `vlm_vit_llm.mrope` gives them.
        image_mask: `[B, L]` bool, True where an image token goes.
        image_features: `[total image tokens, D]`, in the order of the True positions.
        labels: `[B, L]` target ids, `IGNORE_INDEX` on prompt, image and pad positions; None
            without targets.
        record_index: `[B, L]`, the prompt each token belongs to (-1 on padding).
        packing: None for one prompt per row (padded); for packed rows (`prepare(pack=...)`,
            `vlm_vit_llm.packing`), the attention path that confines each record.
        idle_features: `[M, D]`, a blank image's tokens when a batch without images must
            still run the tower (`vlm_vit_llm.parallel.idle_image_features`): `embed` adds
            them times 0.0, which changes no value but joins the tower to the graph; else
            None.
        deepstack_features: for a model with DeepStack (Qwen3-VL, `vlm_vit_llm.deepstack`),
            per DeepStack layer `[total image tokens, D]`, in the order of `image_features`;
            else None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    image_mask: torch.Tensor
    image_features: torch.Tensor
    labels: torch.Tensor | None = None
    record_index: torch.Tensor | None = None
    packing: str | None = None
    idle_features: torch.Tensor | None = None
    deepstack_features: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class TiledImage:
    """One image as a tiled tower takes it (`ImageProcessor.tile`).

    Attributes:
        views: `[1 + tiles, C, t, t]`, the base view first, then the tiles row by row.
        size: the original image's (height, width), which sets the tile grid, the
            unpadding and the token count.
    """

    views: torch.Tensor
    size: tuple[int, int]


@dataclass(frozen=True)
class Video:
    """One clip, for a tower with temporal patches (`temporal_patch_size`): one `<image>`
    placeholder stands for all its frames, `tower.num_image_tokens((H, W), frames=T)`
    positions. Only a `Video` is a clip: a list or tuple of images is that many images.

    Attributes:
        frames: the frames in time order (PIL images, files, arrays, `[C, H, W]` tensors),
            or their pixels `[T, C, H, W]`.
        fps: the frames' rate, for a model whose positions follow time (Qwen2.5-VL's M-RoPE
            spaces a clip's temporal patches by `tokens_per_second * temporal_patch / fps`);
            None: transformers' default for frames without metadata, 24.
        indices: each frame's index in the video it was sampled from, whose rate `fps` is
            then (`VideoProcessor.sample`): Qwen3-VL writes each temporal patch's time from
            them. None: frame i is the video's frame i.
    """

    frames: Sequence[Any] | torch.Tensor
    fps: float | None = None
    indices: tuple[int, ...] | None = None
