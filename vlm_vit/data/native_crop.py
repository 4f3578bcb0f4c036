"""One random-resized crop per image at native resolution: the crop keeps its own aspect
ratio, resized to the most patches within a token budget (`multicrop.grid_size`).

I-JEPA's augmentation is a random-resized crop of area scale (0.3, 1) and nothing else (no
flip, no colour); `NativeCrop` draws the crop box as torchvision's `RandomResizedCrop`
does (aspect ratio log-uniform in 3/4..4/3) and, in place of a fixed square, sizes each
crop by `tokens`. Batches of such crops differ in size: `collate_native` hands them on as
`PackedImages`, which packed objectives encode in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlm_vit.data.multicrop import CROP_RATIO, grid_size
from vlm_vit.optional import require
from vlm_vit.processor import NORMALIZATION, ImageProcessor


class NativeCrop:
    """A crop of each image, at its own aspect ratio within a token budget, drawn from a seed.

    Args:
        patch_size: the encoder's patch size; both output sides are multiples of it.
        tokens: the budget per crop, in patches.
        scale: the crop's area as a fraction of the image (I-JEPA: (0.3, 1.0)).
        flip: flip horizontally with probability 0.5 (I-JEPA: no).
        mean, std: per-channel normalisation.

    Raises:
        ValueError: for a bad argument, naming it and its value.
    """

    def __init__(self, *, patch_size: int, tokens: int,
                 scale: tuple[float, float] = (0.3, 1.0), flip: bool = False,
                 mean: Sequence[float] = NORMALIZATION["imagenet"][0],
                 std: Sequence[float] = NORMALIZATION["imagenet"][1]) -> None:
        transforms = require("torchvision.transforms.v2", "train", "native-resolution crops")
        for name, value in (("patch_size", patch_size), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (len(scale) == 2 and 0.0 < scale[0] <= scale[1] <= 1.0):
            raise ValueError(f"scale must be (min, max) in (0, 1] with min <= max, got "
                             f"{tuple(scale)!r}")
        self.patch_size, self.tokens = patch_size, tokens
        self.scale, self.flip = (float(scale[0]), float(scale[1])), flip
        self.decoder = ImageProcessor(size=patch_size, mean=tuple(mean), std=tuple(std))
        self._box = require("torchvision.transforms", "train",
                            "native-resolution crops").RandomResizedCrop.get_params
        self._functional = transforms.functional
        self._bicubic = transforms.InterpolationMode.BICUBIC
        self._pixels = transforms.Compose([transforms.ToImage(),
                                           transforms.ToDtype(torch.uint8, scale=True)])
        after = [transforms.RandomHorizontalFlip(p=0.5)] if flip else []
        self._finish = transforms.Compose([
            *after, transforms.ToDtype(torch.float32, scale=True),
            transforms.Normalize(list(self.decoder.mean), list(self.decoder.std))])

    def __call__(self, image: Any, seed: int) -> torch.Tensor:
        """The crop, `[3, h, w]`; `image` as `decoder.load` returns it."""
        # torchvision draws from the global torch RNG; fork it so the draws depend on `seed`.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pixels = self._pixels(image)
            top, left, height, width = self._box(pixels, list(self.scale), list(CROP_RATIO))
            size = grid_size(height, width, patch=self.patch_size, max_patches=self.tokens)
            crop = self._functional.resized_crop(pixels, top, left, height, width, list(size),
                                                 interpolation=self._bicubic, antialias=True)
            return self._finish(crop).as_subclass(torch.Tensor)

    def __repr__(self) -> str:
        return (f"NativeCrop(patch_size={self.patch_size}, tokens={self.tokens}, scale="
                f"{self.scale}, flip={self.flip}, mean={self.decoder.mean}, "
                f"std={self.decoder.std})")
