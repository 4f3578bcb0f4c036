"""An image as a `VisionTower` takes it, and the tokens it makes there: what
`MultimodalLM.prepare` does with each image it is given, from the tower and its processor
alone.
"""

from __future__ import annotations

from typing import Any

import torch

from vlm_vit import ImageProcessor, VisionTower
from vlm_vit_llm.batch_types import TiledImage


def as_pixels(image: Any, tower: VisionTower, processor: ImageProcessor,
              prompt: int) -> torch.Tensor | TiledImage:
    """An image as the tower takes it: `[C, H, W]`, a `TiledImage` for a tiled tower, or
    a clip `[T, C, H, W]` (a tuple of frames, or a 4-D tensor) for temporal patches.

    Args:
        image: a PIL image, a file, an array, a pixel tensor, or a `TiledImage`.
        tower, processor: the tower and the processor that turns files into its pixels.
        prompt: the prompt's index, for the errors.

    Raises:
        ValueError: naming the prompt, for pixels of the wrong shape, or a clip on a tower
            without temporal patches.
    """
    if tower.tiling is not None:
        return as_tiled(image, processor, prompt)
    channels = tower.encoder.config.in_channels
    if isinstance(image, tuple):  # a video's frames
        image = torch.stack([as_pixels(frame, tower, processor, prompt) for frame in image]) \
            if image else torch.empty(0)
    if isinstance(image, torch.Tensor):
        if image.ndim == 4 and image.shape[0] == 1:
            image = image[0]
        clip = image.ndim == 4 and len(image) > 1
        if clip and tower.encoder.config.temporal_patch_size is None:
            raise ValueError(f"prompt {prompt}: a clip of {len(image)} frames needs a tower "
                             "with temporal patches (temporal_patch_size); this one has none")
        if image.ndim != 3 + clip or image.shape[-3] != channels:
            raise ValueError(f"prompt {prompt}: a pixel tensor must be [C, H, W] (or a clip "
                             f"[T, C, H, W]) with C = {channels}, got {tuple(image.shape)}")
        return image
    return processor.preprocess_one(image)


def as_tiled(image: Any, processor: ImageProcessor, prompt: int) -> TiledImage:
    """An image (or a `TiledImage`) as a tiled tower's views and original size.

    Raises:
        ValueError: for a float tensor, which has lost the original size.
    """
    if isinstance(image, TiledImage):
        return image
    if isinstance(image, torch.Tensor) and image.dtype != torch.uint8:
        raise ValueError(f"prompt {prompt}: the tower tiles images (AnyRes), and a float "
                         f"tensor of shape {tuple(image.shape)} has lost the original size; "
                         "give the image itself, or TiledImage(views, size) as "
                         "ImageProcessor.tile gives them")
    views, sizes = processor.tile([image])
    return TiledImage(views[0], sizes[0])


def token_count(tower: VisionTower, pixels: torch.Tensor | TiledImage) -> int:
    """The tokens an image given as `as_pixels` makes: by its original size when tiled."""
    if isinstance(pixels, TiledImage):
        return tower.num_image_tokens(tuple(pixels.size))
    if pixels.ndim == 4:  # a clip [T, C, H, W]
        return tower.num_image_tokens(tuple(pixels.shape[2:]), frames=len(pixels))
    return tower.num_image_tokens(tuple(pixels.shape[1:]))
