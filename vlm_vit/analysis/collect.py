"""Running images through the encoder one at a time and reducing each image's attention
maps to small numbers at once, so memory holds one image's maps, never all of them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlm_vit.analysis.attention import (
    attention_rollout,
    mean_attention_distance,
    prefix_attention,
    rollout_grid,
)
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor


@dataclass
class ImageAttention:
    """What one image's attention maps come to.

    Attributes:
        name: the file path, or `images[i]` for an image given in memory.
        pixels: `[C, H, W]`, the normalised pixels the encoder saw.
        grid: the patch grid (rows, cols).
        distance: `[depth, heads]`, mean attention distance in pixels (patch to patch).
        prefix_share: `[depth, heads]`, the mean weight patch queries give prefix tokens.
        rollout: `[rows, cols]`, the rollout map (`attention.rollout_grid`).
    """

    name: str
    pixels: torch.Tensor
    grid: tuple[int, int]
    distance: torch.Tensor
    prefix_share: torch.Tensor
    rollout: torch.Tensor


def image_attention(encoder: VisionEncoder, pixels: torch.Tensor, name: str = "image"
                    ) -> ImageAttention:
    """Runs one image through the encoder's `output_attentions` path and reduces its maps.

    Args:
        encoder: any encoder; its fast attention kernels stay as they are, the maps are
            computed explicitly with the same weights.
        pixels: `[1, C, H, W]`, already preprocessed.
        name: what to call the image.
    """
    if pixels.ndim != 4 or pixels.shape[0] != 1:
        raise ValueError(f"image_attention takes one image [1, C, H, W], got "
                         f"{list(pixels.shape)}")
    parameter = next(encoder.parameters())
    with torch.inference_mode():
        out = encoder(pixels.to(device=parameter.device, dtype=parameter.dtype),
                      output_attentions=True)
        patch_size = encoder.config.patch_size
        prefix = out.num_prefix_tokens
        # depth maps of (1, heads, T, T) become (depth, heads) and (rows, cols) numbers
        distance = torch.cat([mean_attention_distance(a, out.grid, patch_size, prefix)
                              for a in out.attentions])
        share = torch.cat([prefix_attention(a, prefix) for a in out.attentions])
        rollout = rollout_grid(attention_rollout(out.attentions), out.grid, prefix,
                               encoder.config.class_token)[0]
    return ImageAttention(name=name, pixels=pixels[0].cpu(), grid=out.grid,
                          distance=distance.double().cpu(), prefix_share=share.double().cpu(),
                          rollout=rollout.float().cpu())


def iter_image_attention(encoder: VisionEncoder, images: Iterable[Any],
                         processor: ImageProcessor) -> Iterator[ImageAttention]:
    """`image_attention` for each image in turn, the encoder always called with batch 1.

    Args:
        encoder: the encoder to inspect.
        images: files, PIL images, arrays or tensors (a `[B, C, H, W]` tensor counts as B
            images), anything `processor` takes.
        processor: the preprocessing.
    """
    for index, image in enumerate(images):
        base = str(image) if isinstance(image, (str, Path)) else f"images[{index}]"
        pixels = processor(image)  # (1, C, H, W); (B, C, H, W) for a batch tensor
        for row in range(pixels.shape[0]):
            name = base if pixels.shape[0] == 1 else f"{base}[{row}]"
            yield image_attention(encoder, pixels[row:row + 1], name)
