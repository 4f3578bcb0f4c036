"""DINOv2's multi-crop augmentation (Oquab et al. 2023, "DINOv2: Learning Robust Visual
Features without Supervision"; `DataAugmentationDINO`): two global crops and several local
crops of one image, each distorted on its own, at square sizes or at native resolution within
a token budget; and `ViewBatch`, the batch they collate to.

Like `Augmentation`, every random draw comes from the item's seed only, so the views are the
same whatever the number of workers and after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlm_vit.data.samples import ImageBatch, UndecodableImage, decoded_items
from vlm_vit.optional import require
from vlm_vit.processor import NORMALIZATION, ImageProcessor

#: The crop box's aspect ratio (width / height) is drawn log-uniformly from this range, as
#: torchvision's `RandomResizedCrop` (and so DINOv2) draws it.
CROP_RATIO = (3 / 4, 4 / 3)
#: Square mode's sides when none are given: DINOv2's `global_crops_size`, `local_crops_size`.
GLOBAL_SIZE, LOCAL_SIZE = 224, 96
#: Gaussian blur's probability on global crop 1, global crop 2 and each local crop.
BLUR_PROBABILITY = (1.0, 0.1, 0.5)


@dataclass
class Views:
    """One image's crops, each a normalised float32 `[3, h, w]` tensor.

    Attributes:
        global_views: the 2 global crops (crop 2 alone may be solarised).
        local_views: the local crops.
    """

    global_views: list[torch.Tensor]
    local_views: list[torch.Tensor]


def grid_size(height: float, width: float, *, patch: int, max_patches: int) -> tuple[int, int]:
    """The (height, width) a crop of `height` x `width` pixels is resized to at native
    resolution: the most patches, at most `max_patches`, among the grids whose one side is
    the other times the crop's aspect ratio, rounded (so the aspect is kept to within half a
    patch on one side). Small crops are scaled up to fill the budget, as a square crop is.

    Worked numbers, (height, width) -> (height, width):

    - Any square crop, patch 14: 224 x 224 with 256 patches, 84 x 84 with 36.
    - ``skimage.data.coffee()``, 400 x 600, patch 16, 256 patches: 208 x 304 (13 x 19 = 247).

    Args:
        height: the crop's height in pixels.
        width: the crop's width in pixels.
        patch: every output side is a positive multiple of this.
        max_patches: the token budget, in patches.

    Returns:
        (height, width), multiples of `patch` holding at most `max_patches` patches.

    Raises:
        ValueError: for a size that is not positive, or a patch or budget that is not a
            positive int.
    """
    for name, value in [("height", height), ("width", width)]:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    for name, value in [("patch", patch), ("max_patches", max_patches)]:
        if not _is_positive_int(value):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    aspect = width / height
    best = (1, 1)
    # Walk the rows (columns = rows x aspect, rounded), then the columns; each walk's area
    # only grows, so it stops at the first grid over the budget.
    for by_rows in (True, False):
        step = 1
        while True:
            if by_rows:
                rows, cols = step, max(1, round(step * aspect))
            else:
                rows, cols = max(1, round(step / aspect)), step
            if rows * cols > max_patches:
                break
            if rows * cols > best[0] * best[1]:
                best = (rows, cols)
            step += 1
    return best[0] * patch, best[1] * patch


class MultiCrop:
    """DINOv2's multi-crop augmentation, drawn from a seed.

    Each crop's box is drawn as `RandomResizedCrop` draws it (an area fraction in its scale
    range, an aspect ratio log-uniform in `CROP_RATIO`) and resized with bicubic
    interpolation; then, as DINOv2: a horizontal flip (p 0.5), colour jitter (brightness 0.4,
    contrast 0.4, saturation 0.2, hue 0.1; p 0.8), grayscale (p 0.2), Gaussian blur (kernel
    9, sigma 0.1..2; p `BLUR_PROBABILITY`), solarisation at 128 (p 0.2, global crop 2 only),
    and normalisation. The distortions run on uint8 pixels, as DINOv2's PIL pipeline does.

    Square mode (no token budgets, for parity with DINOv2) resizes every global crop to
    `global_size` squared and every local crop to `local_size` squared. Native mode
    (`global_tokens`, `local_tokens`) resizes each crop to `grid_size` of its box: its own
    aspect ratio, within the budget; DINOv2's 224 / 96 at patch 14 are 256 / 36 tokens.

    Inputs are decoded like `vlm_vit.processor` does, through `decoder.load`, so `ImageFolder`
    (`augmentation=`) and `ImageDecode` use it as they use `Augmentation`.

    Args:
        patch_size: the encoder's patch size; every output side is a multiple of it.
        global_size: square mode's global side (default `GLOBAL_SIZE`).
        local_size: square mode's local side (default `LOCAL_SIZE`; 98 for patch 14, as
            DINOv2's ViT/14 configs use).
        global_scale: the global crop's area as a fraction of the image (min, max).
        local_scale: the local crop's area as a fraction of the image (min, max).
        local_crops: local crops per image; there are always 2 global crops.
        mean: per-channel mean.
        std: per-channel standard deviation.
        global_tokens: native mode's budget per global crop, in patches.
        local_tokens: native mode's budget per local crop (needed when `local_crops` > 0).

    Raises:
        ValueError: for a bad argument, naming it and its value.
    """

    def __init__(
        self,
        *,
        patch_size: int,
        global_size: int | None = None,
        local_size: int | None = None,
        global_scale: tuple[float, float] = (0.32, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.32),
        local_crops: int = 8,
        mean: Sequence[float] = NORMALIZATION["imagenet"][0],
        std: Sequence[float] = NORMALIZATION["imagenet"][1],
        global_tokens: int | None = None,
        local_tokens: int | None = None,
    ) -> None:
        transforms = require("torchvision.transforms.v2", "train", "multi-crop augmentation")
        if not _is_positive_int(patch_size):
            raise ValueError(f"patch_size must be a positive int, got {patch_size!r}")
        if not (_is_int(local_crops) and local_crops >= 0):
            raise ValueError(f"local_crops must be a non-negative int, got {local_crops!r}")
        self.patch_size, self.local_crops = int(patch_size), int(local_crops)
        self.global_scale = _checked_scale("global_scale", global_scale)
        self.local_scale = _checked_scale("local_scale", local_scale)
        self.native = global_tokens is not None
        if self.native:
            self.global_tokens = _checked_tokens("global_tokens", global_tokens)
            if local_tokens is None and self.local_crops > 0:
                raise ValueError(f"native mode needs local_tokens for its {self.local_crops} "
                                 "local crops (DINOv2's 96 pixels at patch 14: 36)")
            self.local_tokens = (None if local_tokens is None
                                 else _checked_tokens("local_tokens", local_tokens))
            for name, value in [("global_size", global_size), ("local_size", local_size)]:
                if value is not None:
                    raise ValueError(f"{name} {value!r} is for square mode; native mode sizes "
                                     "each crop by global_tokens and local_tokens")
            self.global_size = self.local_size = None
        else:
            if local_tokens is not None:
                raise ValueError(f"local_tokens {local_tokens!r} needs global_tokens (native "
                                 "mode); square mode uses global_size and local_size")
            self.global_tokens = self.local_tokens = None
            self.global_size = self._checked_side("global_size", global_size, GLOBAL_SIZE)
            self.local_size = self._checked_side("local_size", local_size, LOCAL_SIZE)
        # The processor only decodes here; its size and resizing are unused.
        self.decoder = ImageProcessor(size=self.global_size or GLOBAL_SIZE, mean=tuple(mean),
                                      std=tuple(std))
        self._functional = transforms.functional
        self._bicubic = transforms.InterpolationMode.BICUBIC
        self._box = require("torchvision.transforms", "train",
                            "multi-crop augmentation").RandomResizedCrop.get_params
        self._pixels = transforms.Compose([transforms.ToImage(),
                                           transforms.ToDtype(torch.uint8, scale=True)])
        # What follows each crop's resize: DINOv2's flip, colour distortion and its
        # per-crop "extra", then normalisation.
        distort = [transforms.RandomHorizontalFlip(p=0.5),
                   transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                   transforms.RandomGrayscale(p=0.2)]
        normalize = [transforms.ToDtype(torch.float32, scale=True),
                     transforms.Normalize(list(self.decoder.mean), list(self.decoder.std))]

        def blur(probability: float) -> Any:
            return transforms.RandomApply(
                [transforms.GaussianBlur(kernel_size=9, sigma=(0.1, 2.0))], p=probability)

        first, second, local = BLUR_PROBABILITY
        solarize = transforms.RandomSolarize(threshold=128, p=0.2)
        self.global_transforms = (
            transforms.Compose([*distort, blur(first), *normalize]),
            transforms.Compose([*distort, blur(second), solarize, *normalize]))
        self.local_transform = transforms.Compose([*distort, blur(local), *normalize])

    def _checked_side(self, name: str, value: int | None, default: int) -> int:
        value = default if value is None else value
        if not (_is_positive_int(value) and value % self.patch_size == 0):
            nearest = max(1, round(value / self.patch_size)) * self.patch_size \
                if _is_positive_int(value) else self.patch_size
            raise ValueError(f"{name} must be a positive multiple of patch_size "
                             f"{self.patch_size}, got {value!r} (nearest: {nearest})")
        return int(value)

    def __call__(self, image: Any, seed: int) -> Views:
        """The 2 global and `local_crops` local views; `image` as `decoder.load` returns it."""
        # torchvision draws from the global torch RNG; fork it so the draws depend on `seed`
        # only and the caller's RNG is left untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pixels = self._pixels(image)  # uint8 [3, H, W]
            global_views = [self._view(pixels, self.global_scale, self.global_size,
                                       self.global_tokens, transform)
                            for transform in self.global_transforms]
            local_views = [self._view(pixels, self.local_scale, self.local_size,
                                      self.local_tokens, self.local_transform)
                           for _ in range(self.local_crops)]
        return Views(global_views, local_views)

    def _view(self, pixels: torch.Tensor, scale: tuple[float, float], side: int | None,
              tokens: int | None, transform: Any) -> torch.Tensor:
        """One crop: its box, resized to its side (square) or budget (native), distorted."""
        top, left, height, width = self._box(pixels, list(scale), list(CROP_RATIO))
        size = (side, side) if tokens is None else grid_size(
            height, width, patch=self.patch_size, max_patches=tokens)
        crop = self._functional.resized_crop(pixels, top, left, height, width, list(size),
                                             interpolation=self._bicubic, antialias=True)
        return transform(crop).as_subclass(torch.Tensor)

    def __repr__(self) -> str:
        sizes = (f"global_tokens={self.global_tokens}, local_tokens={self.local_tokens}"
                 if self.native else
                 f"global_size={self.global_size}, local_size={self.local_size}")
        return (f"MultiCrop(patch_size={self.patch_size}, {sizes}, global_scale="
                f"{self.global_scale}, local_scale={self.local_scale}, local_crops="
                f"{self.local_crops}, mean={self.decoder.mean}, std={self.decoder.std})")


#: One view index across a batch: `[B, 3, h, w]` when the B crops share a size, else B
#: `[3, h, w]` tensors. Either way `[i]` is image i's crop, and iterating keeps the order.
ViewColumn = torch.Tensor | list[torch.Tensor]


@dataclass
class ViewBatch:
    """The views of B images, by view index, as `collate_views` builds them.

    Square mode's columns are always stacked tensors; native mode's are lists unless every
    image's crop happens to have one size. `ImageBatch.pixel_values` may be a `ViewBatch`:
    it has the `len`, `.to(device)` and `.tensor_split(n)` the trainer uses.

    Attributes:
        global_views: 2 columns: `global_views[v][i]` is image i's global crop v.
        local_views: one column per local crop: `local_views[v][i]` is image i's local crop v.
    """

    global_views: list[ViewColumn]
    local_views: list[ViewColumn]

    def __len__(self) -> int:
        """B, the images."""
        return len(self.global_views[0]) if self.global_views else 0

    def to(self, *args: Any, **kwargs: Any) -> ViewBatch:
        """Every view through `Tensor.to(*args, **kwargs)` (e.g. a device, non_blocking)."""
        def moved(column: ViewColumn) -> ViewColumn:
            if isinstance(column, torch.Tensor):
                return column.to(*args, **kwargs)
            return [view.to(*args, **kwargs) for view in column]

        return ViewBatch([moved(column) for column in self.global_views],
                         [moved(column) for column in self.local_views])

    def tensor_split(self, sections: int | Sequence[int]) -> tuple[ViewBatch, ...]:
        """The images split in order as `torch.tensor_split` splits B rows (n ~equal shares
        for an int; shares may be empty)."""
        shares = torch.tensor_split(torch.arange(len(self)), sections)
        ends = np.cumsum([len(share) for share in shares]).tolist()
        return tuple(ViewBatch([column[start:end] for column in self.global_views],
                               [column[start:end] for column in self.local_views])
                     for start, end in zip([0, *ends[:-1]], ends, strict=True))


def collate_views(items: Sequence[Views | UndecodableImage | None]) -> ImageBatch:
    """Collates `MultiCrop` views into a `ViewBatch`, dropping files that did not decode.

    Args:
        items: `Views`, `UndecodableImage` markers, or None.

    Returns:
        The batch; its `pixel_values` is a `ViewBatch`, of length 0 when nothing decoded.

    Raises:
        TypeError: for an item of any other type.
        ValueError: when the items do not all have the same number of local views.
    """
    views, bad = decoded_items(items, Views, "collate_views", "Views")
    counts = sorted({len(item.local_views) for item in views})
    if len(counts) > 1:
        raise ValueError(f"items have different numbers of local views: {counts}")
    return ImageBatch(ViewBatch(_columns([item.global_views for item in views]),
                                _columns([item.local_views for item in views])), bad)


def _columns(rows: list[list[torch.Tensor]]) -> list[ViewColumn]:
    """Per-image lists of views -> per-view columns, stacked where the sizes agree."""
    columns = [list(column) for column in zip(*rows, strict=True)]
    return [torch.stack(column) if len({view.shape for view in column}) == 1 else column
            for column in columns]


def _checked_scale(name: str, scale: Any) -> tuple[float, float]:
    if not (isinstance(scale, (tuple, list)) and len(scale) == 2
            and all(isinstance(value, (int, float)) and not isinstance(value, bool)
                    for value in scale)
            and 0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"{name} must be (min, max) with 0 < min <= max <= 1, got {scale!r}")
    return float(scale[0]), float(scale[1])


def _checked_tokens(name: str, tokens: Any) -> int:
    if not _is_positive_int(tokens):
        raise ValueError(f"{name} must be a positive int (patches per crop), got {tokens!r}")
    return int(tokens)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


__all__ = ["BLUR_PROBABILITY", "CROP_RATIO", "GLOBAL_SIZE", "LOCAL_SIZE", "MultiCrop",
           "ViewBatch", "Views", "collate_views", "grid_size"]
