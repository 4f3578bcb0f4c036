"""An image as a `VisionTower` takes it, and the tokens it makes there: what
`MultimodalLM.prepare` does with each image it is given, from the tower and its processor
alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from vlm_vit import ImageProcessor, VisionTower
from vlm_vit_llm.batch_types import TiledImage, Video
from vlm_vit_llm.video_processor import VideoProcessor

Pixels = torch.Tensor | TiledImage | Video  # `[C, H, W]`, tiled views, or a clip's `[T, C, H, W]`


def as_pixels(image: Any, tower: VisionTower, processor: ImageProcessor, prompt: int,
              video: VideoProcessor | None = None) -> Pixels:
    """An image as the tower takes it: `[C, H, W]`, a `TiledImage` for a tiled tower, or for
    a `Video` a `Video` of its pixels `[T, C, H, W]`.

    Args:
        image: a PIL image, a file, an array, a pixel tensor, a `TiledImage` or a `Video`.
        tower, processor: the tower and the processor that turns files into its pixels.
        prompt: the prompt's index, for the errors.
        video: what sizes a clip's frames together (Qwen-VL's video processors); None:
            each frame as `processor` makes an image.

    Raises:
        ValueError: naming the prompt, for pixels of the wrong shape, a list or tuple (not an
            image), or a `Video` on a tower without temporal patches.
    """
    if isinstance(image, Video):
        return replace(image, frames=_clip(image.frames, tower, processor, prompt, video))
    if isinstance(image, (list, tuple)):
        raise ValueError(f"prompt {prompt}: a {type(image).__name__} of {len(image)} is not "
                         "an image: give each image in the prompt's list, or a clip as "
                         "Video(frames)")
    if tower.tiling is not None:
        return as_tiled(image, processor, prompt)
    channels = tower.encoder.config.in_channels
    if isinstance(image, torch.Tensor):
        if image.ndim == 4 and image.shape[0] == 1:
            image = image[0]
        if image.ndim == 4:
            raise ValueError(f"prompt {prompt}: a pixel tensor of {len(image)} frames "
                             f"{tuple(image.shape)}: give a clip as Video(frames)")
        if image.ndim != 3 or image.shape[0] != channels:
            raise ValueError(f"prompt {prompt}: a pixel tensor must be [C, H, W] with "
                             f"C = {channels}, got {tuple(image.shape)}")
        return image
    return processor.preprocess_one(image)


def _clip(frames: Any, tower: VisionTower, processor: ImageProcessor, prompt: int,
          video: VideoProcessor | None) -> torch.Tensor:
    """A `Video`'s frames as pixels `[T, C, H, W]`: by `video`, else each frame as
    `as_pixels` makes it; pixels given as a tensor as they are."""
    count = len(frames)
    if tower.encoder.config.temporal_patch_size is None or tower.tiling is not None:
        raise ValueError(f"prompt {prompt}: a clip of {count} frames needs a tower with "
                         "temporal patches (temporal_patch_size), untiled; this one has none")
    if not isinstance(frames, torch.Tensor):
        if count == 0:
            raise ValueError(f"prompt {prompt}: a Video without frames")
        if video is not None:
            frames = video(frames, processor, f"prompt {prompt}: clip")
        else:
            frames = torch.stack([as_pixels(frame, tower, processor, prompt)
                                  for frame in frames])
    channels = tower.encoder.config.in_channels
    if frames.ndim != 4 or frames.shape[1] != channels or count == 0:
        raise ValueError(f"prompt {prompt}: a Video's pixels must be [T, C, H, W] with T >= 1 "
                         f"and C = {channels}, got {tuple(frames.shape)}")
    return frames


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


def token_count(tower: VisionTower, pixels: Pixels) -> int:
    """The tokens an image given as `as_pixels` makes: by its original size when tiled, by
    its frames and size for a `Video`."""
    if isinstance(pixels, TiledImage):
        return tower.num_image_tokens(tuple(pixels.size))
    if isinstance(pixels, Video):  # [T, C, H, W]
        return tower.num_image_tokens(tuple(pixels.frames.shape[2:]), frames=len(pixels.frames))
    return tower.num_image_tokens(tuple(pixels.shape[1:]))
